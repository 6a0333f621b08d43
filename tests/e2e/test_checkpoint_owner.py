"""#26 item 1 through the CLI, as it was reproduced: the same TOML launched twice with one
`checkpoint.uri`. Before, the second run replaced the first run's steps, pruned them and resumed
from them; now it is refused before any worker starts, and the first run's checkpoints are
untouched and still resume."""

from __future__ import annotations

from shardwise.cli.main import main
from shardwise.data.ledger import audit
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.cli import assert_user_error
from tests.support.specs import tiny_spec_dict


def test_a_second_run_of_the_same_toml_cannot_take_the_first_runs_location(small_corpus,
                                                                           tmp_path, capsys):
    shared = tmp_path / "shared-checkpoints"
    data = tiny_spec_dict(small_corpus, tmp_path / "unused", run={"dir": "", "steps": 2},
                          checkpoint={"enabled": True, "uri": str(shared), "async_save": False})
    config = tmp_path / "sweep.toml"
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    first = tmp_path / "a"
    assert main(["train", str(config), "--set", f'run.dir="{first}"']) == 0
    capsys.readouterr()
    before = sorted(p.name for p in shared.iterdir())
    assert "step-000002" in before and "owner.json" in before

    assert_user_error((main(["train", str(config), "--set", f'run.dir="{tmp_path / "b"}"',
                             "--set", "optimizer.lr=3e-3"]), *capsys.readouterr()),
                      f"checkpoint location {shared} belongs to another run (run directory "
                      f"{first.resolve()}", "checkpoint.uri")
    assert not (tmp_path / "b").exists()  # refused before its run directory was made
    assert sorted(p.name for p in shared.iterdir()) == before

    assert main(["train", "--resume", str(first), "--set", "run.steps=3"]) == 0
    assert audit(first).exact and audit(first).steps == 3
