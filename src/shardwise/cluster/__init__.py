"""Running on a cluster: the torchrun command of each node, Slurm batch scripts and job state,
and the checks that catch a cluster mistake before any job starts (an endpoint that does not
parse, a run directory other nodes cannot see, a partition Slurm does not know).

Imports no torch: building a command or a batch script must be instant on a login node.
"""
