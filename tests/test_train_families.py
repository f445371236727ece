"""The two families side by side (``speed.train.families``): the comparison's config refuses what it cannot
compare, ``jobs/compare_families.py`` turns its flags into that config, and ``compare_families`` trains both tiny
families, sizes the LM to the T5 and writes one row of each, evaluated on the same examples."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from job_helpers import job_module

from speed.analysis.families import load_families
from speed.train.config import job_from_layers
from speed.train.families import FAMILIES_FILE, FAMILIES_SCHEMA, FamiliesConfig, compare_families


def _job_module():
    return job_module("compare_families")


def _jobs(storage, tokenizer, task: str = "translate_en_de"):
    """A tiny T5 2x3 and a tiny LM 1+2x3+1: two steps of four examples each, no evaluation, no tracking."""
    flags = {
        "data.task": task, "data.limit": 16, "data.tokenizer": str(tokenizer), "data.max_source_len": 32,
        "data.max_target_len": 16, "train.batch_size": 4, "train.max_steps": 2, "train.checkpoint_every": 2,
        "train.log_every": 1, "optim.warmup_steps": 1, "scale.cpus_per_worker": 1, "run.storage_path": str(storage),
        "eval": None, "tracking": None,
    }  # fmt: skip
    t5 = {"model.preset": "tiny", "model.pattern": "2x3", "run.name": "t5"}
    lm = {"model.family": "lm", "model.preset": "tiny", "model.pattern": "1+2x3+1", "run.name": "lm"}
    return [job_from_layers("finetune", None, [], flags | extra) for extra in (t5, lm)]


def test_the_comparison_refuses_what_it_cannot_compare(tiny_tokenizer, tmp_path):
    t5, lm = _jobs(tmp_path, tiny_tokenizer)
    with pytest.raises(ValueError, match="FamiliesConfig.t5 must be a t5 finetuning job, got a lm finetune"):
        FamiliesConfig(lm, lm)
    (other,) = _jobs(tmp_path, tiny_tokenizer, task="summarize")[1:]
    with pytest.raises(ValueError, match="both families train on one task, got translate_en_de and summarize"):
        FamiliesConfig(t5, other)
    t5_pretrain, lm_pretrain = _jobs(tmp_path, tiny_tokenizer, task="pretrain")
    with pytest.raises(ValueError, match="task 'pretrain' has no references to compare on"):
        FamiliesConfig(t5_pretrain, lm_pretrain)


def test_the_family_comparison_job_refuses_a_task_without_references(capsys, monkeypatch):
    job = _job_module()
    monkeypatch.setattr(job, "compare_families", lambda *a: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exit_:
        job.main(["--task", "pretrain"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: task 'pretrain' has no references to compare on")
    # The LM's base job follows the T5's comparison settings (its width and tokenizer come after the T5 trains).
    args = job.parse_args(["--max-steps", "7", "--batch-size", "3", "--lm-pattern", "1+1x2+1"])
    lm = job.family_job(args, "lm", args.lm_pattern, {})
    assert (lm.family.name, lm.model.pattern, lm.train.max_steps, lm.train.batch_size) == ("lm", "1+1x2+1", 7, 3)
    assert lm.eval is None and lm.run.name == "lm-1+1x2+1-translate_en_de-7"


@pytest.mark.ray
@pytest.mark.slow
def test_compare_families_trains_sizes_and_evaluates_both(ray_session, tiny_tokenizer, tmp_path):
    t5, lm = _jobs(tmp_path / "runs", tiny_tokenizer)
    out = compare_families(FamiliesConfig(t5, lm, eval_limit=3, max_new_tokens=4, out=str(tmp_path / "families")))
    table = pq.read_table(out / FAMILIES_FILE)
    assert table.schema.equals(FAMILIES_SCHEMA)
    rows = {r["family"]: r for r in table.to_pylist()}
    assert [rows[f]["pattern"] for f in ("t5", "lm")] == ["2x3", "1+2x3+1"]
    for r in rows.values():  # two steps of four examples, three held-out examples, SPEED exact
        assert (r["train_steps"], r["train_examples"], r["examples"]) == (2, 8, 3) and r["train_tokens"] > 0
        assert r["identical"] and r["accuracy_metric"] == "bleu"
    t5_size, lm_size = rows["t5"]["parameters"], rows["lm"]["parameters"]
    assert abs(lm_size - t5_size) < 0.02 * t5_size  # the LM's FFN width sized to the T5's parameter count
    families = load_families(out)
    assert set(families.evaluations) == {"t5", "lm"}
    references = [families.evaluations[f].predictions.sort_by("example")["reference"] for f in ("t5", "lm")]
    assert references[0].equals(references[1])  # the same held-out examples
