"""Training the looped LM without Ray: packed next-token rows, answer-only labels of prompted examples, the
shared per-loop loss with its weights and settle term, a training step, validation, checkpoints that load as a
``LoopedLM``, and the chat template (the Ray Train runs: tests/test_lm_train_ray.py)."""

from __future__ import annotations

import itertools

import datasets
import pytest
import torch

from speed.chat import CHAT_TEMPLATE, ChatTemplate, render_chat, task_prompt
from speed.config import lm_preset
from speed.data import load_records
from speed.data.batching import collate_lm, encode_prompts, pack_rows
from speed.data.corpus import open_corpus
from speed.data.shards import CorpusSpec, prepare_corpus
from speed.decode.generate import DecodeOptions, generate
from speed.eval.validation import validate
from speed.losses import SettleConfig, loss_weights, settle_loss, settled_loss
from speed.models.checkpoint import load_model, save_model
from speed.models.family import get_family
from speed.models.looped_lm import LoopedLM
from speed.tokenizer import EOS_ID, Tokenizer
from speed.train.batches import BatchPlan
from speed.train.config import job_from_args, job_from_dict, job_to_dict, run_name

datasets.disable_progress_bars()
ROW = 32


def _quiet(line: str) -> None:
    """Progress lines are not under test here."""


@pytest.fixture(scope="module")
def rows(tiny_tokenizer, tmp_path_factory):
    """20 pretraining documents prepared as packed LM rows of ROW tokens."""
    spec = CorpusSpec("pretrain", limit=20, max_source_len=ROW, pack=True, family="lm")
    return open_corpus(prepare_corpus(spec, tiny_tokenizer, str(tmp_path_factory.mktemp("rows")), log=_quiet).uri)


@pytest.fixture(scope="module")
def prompted(tiny_tokenizer, tmp_path_factory):
    """12 Multi30k pairs prepared as the LM's prompted examples."""
    spec = CorpusSpec("translate_en_de", limit=12, max_source_len=160, max_target_len=96, family="lm")
    root = str(tmp_path_factory.mktemp("prompted"))
    return open_corpus(prepare_corpus(spec, tiny_tokenizer, root, log=_quiet).uri)


def test_pack_rows_keeps_every_token_once_in_full_rows():
    documents = [[5, 6, 7, EOS_ID], [8, EOS_ID], [9, 10, 11, 12, 13, EOS_ID]]
    rows, rest = pack_rows([3], documents, 4)
    assert rows == [[3, 5, 6, 7], [EOS_ID, 8, EOS_ID, 9], [10, 11, 12, 13]] and rest == [EOS_ID]
    # Split across calls (chunks), the rows are the same.
    first, carry = pack_rows([3], documents[:1], 4)
    second, carry = pack_rows(carry, documents[1:], 4)
    assert first + second == rows and carry == rest


def test_prepared_rows_are_the_documents_joined_by_eos(rows, tiny_tokenizer):
    tok = Tokenizer.load(tiny_tokenizer)
    documents = tok.encode_batch(load_records("pretrain", "train", limit=20)["text"])  # each ends in EOS
    assert rows.manifest.kind == "rows" and rows.manifest.records == 20
    stored = rows.examples(range(len(rows)), 0, 0)
    assert list(stored) == ["input_ids"]
    assert all(len(r) == ROW for r in stored["input_ids"][:-1]) and 0 < len(stored["input_ids"][-1]) <= ROW
    assert list(itertools.chain(*stored["input_ids"])) == list(itertools.chain(*documents))  # none lost or repeated
    assert list(rows.lengths.__array__()) == [len(r) for r in stored["input_ids"]]


def test_rows_collate_to_next_token_labels():
    batch = collate_lm({"input_ids": [[4, 5, 6, EOS_ID], [7, 8]]})
    assert batch["input_ids"].tolist() == [[4, 5, 6, EOS_ID], [7, 8, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, EOS_ID, -100], [8, -100, -100, -100]]


def test_prompted_examples_carry_the_loss_on_the_answer_only(prompted, tiny_tokenizer):
    tok = Tokenizer.load(tiny_tokenizer)
    assert prompted.manifest.kind == "prompted"
    source = load_records("translate_en_de", "train", limit=1)
    example = prompted.examples([0], 0, 0)
    prompt, answer = example["input_ids"][0], example["labels"][0]
    expected = tok.encode(task_prompt("Translate to German: ", _english(0)), add_eos=False)
    assert prompt == expected
    assert prompt[-1] != EOS_ID and answer[-1] == EOS_ID
    assert tok.decode(answer) == tok.decode(tok.encode(source["target"][0]))
    batch = collate_lm(example)
    labels = batch["labels"][0]
    assert batch["input_ids"][0].tolist() == prompt + answer
    assert (labels[: len(prompt) - 1] == -100).all()  # no loss on the prompt
    assert labels[len(prompt) - 1 : len(prompt) + len(answer) - 1].tolist() == answer  # the answer, then EOS
    assert (labels[len(prompt) + len(answer) - 1 :] == -100).all()


def _english(index: int) -> str:
    """The English side of Multi30k training pair ``index`` (the records' ``source`` holds T5's prefix)."""
    from speed.data.records import iter_records
    from speed.data.tasks import get_task

    table = next(iter_records(get_task("translate_en_de"), "train", limit=index + 1))
    return table.column("source")[index].as_py().removeprefix(get_task("translate_en_de").prefix)


def test_an_overlong_prompt_keeps_the_template_cue(tiny_tokenizer):
    tok = Tokenizer.load(tiny_tokenizer)
    full = tok.encode(task_prompt("", "word " * 200), add_eos=False)
    (cut,) = encode_prompts(["word " * 200], tok, 20)
    assert len(cut) == 20 and cut[-3:] == full[-3:] and cut[:10] == full[:10]


def test_the_lm_loss_is_the_weighted_per_loop_loss_plus_the_settle_term():
    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", pattern="1+2x3+1"))
    batch = collate_lm({"input_ids": [[5, 6, 7, 8, EOS_ID], [9, 10, 11]], "labels": [[12, EOS_ID], [13, 14, EOS_ID]]})
    weights = loss_weights("geometric", 3)
    out = model(**batch, weights=weights, return_logits=True)
    by_hand = torch.stack(
        [torch.nn.functional.cross_entropy(lg.flatten(0, 1), batch["labels"].flatten()) for lg in out.loop_logits]
    )
    torch.testing.assert_close(out.loop_losses, by_hand)
    torch.testing.assert_close(out.loss, (weights * by_hand).sum())
    settle = SettleConfig(kind="to_last", weight=2.0, warmup_steps=4)
    loss, term = settled_loss(out.loss, out.loop_logits, batch["labels"], settle, step=2)
    torch.testing.assert_close(term, settle_loss(out.loop_logits, batch["labels"], settle))
    torch.testing.assert_close(loss, out.loss + 1.0 * term)  # lambda = 2 * 2/4 at step 2
    assert term > 0


def test_a_training_step_lowers_the_loss_and_validation_reports_every_loop(rows):
    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", pattern="2x2", vocab_size=rows.manifest.vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    plan = BatchPlan(rows.lengths, 4, seed=0)
    batch = collate_lm(rows.examples(plan.micro_batches(0)[0], 0, 0))
    losses = []
    for _ in range(5):
        out = model(**batch, weights=loss_weights("linear", 2))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < losses[0]
    v = validate(model, get_family("lm"), rows, batch_size=3)
    assert len(v.losses) == len(v.flip_rate_prev) == 2 and v.flip_rate_prev[0] == 0.0
    assert v.perplexities[-1] == pytest.approx(torch.tensor(v.losses[-1]).exp().item())
    assert v.tokens == sum(len(r) - 1 for r in rows.examples(range(len(rows)), 0, 0)["input_ids"])


def test_the_job_switch_and_the_checkpoint_name_the_family(tmp_path):
    job = job_from_args("pretrain", ["--model", "lm", "--preset", "tiny", "--pattern", "1+2x2+1"])
    assert isinstance(job.model, type(lm_preset("tiny"))) and job.family.name == "lm"
    assert job_to_dict(job)["model"]["family"] == "lm" and job_from_dict(job_to_dict(job)) == job
    assert run_name(job) != run_name(job_from_args("pretrain", ["--preset", "tiny", "--pattern", "2x2"]))
    with pytest.raises(ValueError, match="unknown model family"):
        job_from_args("pretrain", ["--model", "gpt"])
    model = LoopedLM(job.model).eval()
    save_model(tmp_path, model)
    loaded = load_model(tmp_path)
    assert isinstance(loaded.model, LoopedLM) and loaded.config["family"] == "lm"
    assert loaded.config["chat_template"] == {"turn": CHAT_TEMPLATE.turn, "cue": CHAT_TEMPLATE.cue}
    prompt = torch.tensor([[5, 6, 7]])
    speed = generate(loaded.model, prompt, options=DecodeOptions(method="speed", max_new_tokens=6, trace=False))
    sequential = generate(model, prompt, options=DecodeOptions(method="sequential", max_new_tokens=6, trace=False))
    assert speed.tokens == sequential.tokens


def test_the_chat_template_renders_messages_as_a_training_prompt():
    messages = [{"role": "user", "content": "Translate to German: A dog runs."}]
    assert render_chat(messages) == "<user> Translate to German: A dog runs.\n<assistant>"
    assert render_chat(messages) == task_prompt("Translate to German: ", "A dog runs.")
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert render_chat(system).startswith("<system> Be brief.\n<user> ")
    assert render_chat(messages, ChatTemplate("{role}: {content}\n", "assistant:")).endswith("\nassistant:")
    for bad in ([], [{"role": "robot", "content": "hi"}], [{"role": "user", "content": None}]):
        with pytest.raises(ValueError):
            render_chat(bad)
    with pytest.raises(ValueError, match="content"):
        ChatTemplate("{role}", "x")
