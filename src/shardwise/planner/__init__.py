"""The planner: choose a layout before booking the cluster. Imports no torch.

`predict(layout, model, cluster, batch, params)` is the cost model (memory, compute,
communication, bubble); `search` ranks every valid layout by predicted tokens/s. Modules, one job
each: `cluster` (presets), `models` (what the planner knows of a model), `layout` (a candidate and
its validity), `memory`, `compute` (FLOPs), `kernels` (kernel time by op class on a GPU), `comm`
(collectives and placement), `dpcomm` (data-parallel traffic), `bubble`, `overhead` (framework
overhead), `params` (`CostParams`), `cost` (`predict`), `prediction` (what it returns),
`search`, `report` (table, JSON, RunSpec), `calibrate` (the error on finished runs and the
CostParams that fit them), `fit` (the will-it-fit check `shardwise train` runs); against
published runs: `published` (the reference set), `validate` (predict, score, fit, leave one
source out), `published_report`, `fitted` (the fit, generated), `accuracy` (the interval),
`explain` (`--explain`), `costing` (`--tokens`).
"""

from shardwise.planner.cost import CostParams, Prediction, predict, predict_memory
from shardwise.planner.hf_config import dims_from_hf_config
from shardwise.planner.layout import Batch, Layout, layout_problem
from shardwise.planner.models import ModelDims
from shardwise.planner.search import PlanResult, SearchSpace, search, smallest_cluster

__all__ = ["Batch", "CostParams", "Layout", "ModelDims", "PlanResult", "Prediction", "SearchSpace",
           "dims_from_hf_config", "layout_problem", "predict", "predict_memory", "search",
           "smallest_cluster"]
