"""Hugging Face Trainer with StormCallback: a tiny Llama trained through the embedded store,
losses and parameters bit-identical to the same run without STORM, with offload and with a plan."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Trainer test needs transformers installed")

import storm  # noqa: E402
from integrations_clock import SETTLE_STEPS, StillClock  # noqa: E402
from storm.examples.models import same_bits  # noqa: E402
from storm.integrations.transformers import StormCallback  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 128, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> transformers.LlamaForCausalLM:
    transformers.set_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=4)
    return transformers.LlamaForCausalLM(config)


def train(tmp_path, steps: int, storm_callback: StormCallback | None,
          model: transformers.LlamaForCausalLM | None = None) -> tuple[transformers.LlamaForCausalLM, list]:
    model = model if model is not None else tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("storm" if storm_callback else "plain")), max_steps=steps,
        per_device_train_batch_size=2, learning_rate=1e-3, logging_strategy="no", save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0)
    losses = []  # each step's loss as the model computed it (the Trainer logs rounded ones)
    hook = model.register_forward_hook(lambda m, args, out: losses.append(out.loss.detach().clone()))
    callbacks = [storm_callback] if storm_callback else []
    try:
        transformers.Trainer(model=model, args=args, train_dataset=Tokens(2 * steps), callbacks=callbacks).train()
    finally:
        hook.remove()
    return model, losses


def assert_same(want, got) -> None:
    (ref, ref_losses), (model, losses) = want, got
    assert len(losses) == len(ref_losses) > 0
    assert all(same_bits(a, b) for a, b in zip(ref_losses, losses)), (ref_losses, losses)
    differ = [n for (n, a), b in zip(model.named_parameters(), ref.parameters()) if not same_bits(a, b)]
    assert not differ, f"parameters differ after training: {differ}"


def test_trainer_with_the_callback_trains_bit_identical_through_the_embedded_store(tmp_path):
    callback = StormCallback(mode="embedded", min_bytes=0)
    seen = []
    callback.on_step_end = lambda *a, **k: seen.append(callback.handle.last.stats.offloaded)
    got = train(tmp_path, 3, callback)
    assert seen and all(n > 0 for n in seen)  # every step offloaded
    model = got[0]
    assert storm.enabled.handle_of(model) is None  # disabled at train end
    assert callback.handle.explain().startswith("storm.enable (disabled; as it was then): storm.offload on every "
                                                "forward of LlamaForCausalLM")  # the last step's report
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert_same(train(tmp_path, 3, None), got)


def test_trainer_with_a_plan_settles_bit_identical(tmp_path):
    callback = StormCallback(budget=0.5, mode="embedded", min_bytes=0, clock=StillClock())
    settled = []
    callback.on_step_end = lambda *a, **k: settled.append(callback.handle.planner.settled)
    got = train(tmp_path, SETTLE_STEPS, callback)
    assert settled[-1], settled
    assert_same(train(tmp_path, SETTLE_STEPS, None), got)
    # after train(), the plan is still there to read, named by the model's own modules
    text = callback.handle.explain()
    assert storm.enabled.handle_of(got[0]) is None and "storm.enable (disabled; as it was then)" in text
    assert "\nsettled: " in text and "\ntried the reentrant form against torch's non-reentrant checkpoint" in text
    assert "before the blocks: " in text and "model.embed_tokens" in text.split("after the blocks: ")[0]
    assert "lm_head" in text.split("after the blocks: ")[1], text


class Ragged(torch.utils.data.Dataset):
    """Sequences of 9 to 16 tokens, half of them 16: batches padded to their longest (a data
    collator's dynamic padding) come in every length from 9 to 16, mostly 16."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(3)
        lengths = [16 if i % 2 else int(torch.randint(9, 16, (), generator=g)) for i in range(n)]
        self.ids = [torch.randint(1, 128, (k,), generator=g) for k in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def pad_to_longest(rows: list[dict]) -> dict:
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])], mask[i, :len(r["input_ids"])] = r["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_a_plan_of_batches_padded_to_their_longest_settles_bit_identical(tmp_path):
    """Dynamic padding: each batch as long as its longest sequence. The plan is made for the longest
    batches and holds for the shorter ones (before: each new length traced again, and the plan never
    settled); losses and parameters are those of the run without STORM, bit for bit."""
    steps = 3 * SETTLE_STEPS

    def run(callback: StormCallback | None) -> tuple[transformers.LlamaForCausalLM, list]:
        model = tiny_llama()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / ("storm" if callback else "plain")), max_steps=steps,
            per_device_train_batch_size=2, learning_rate=1e-3, logging_strategy="no", save_strategy="no",
            report_to=[], use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0)
        losses: list = []
        hook = model.register_forward_hook(lambda m, args, out: losses.append(out.loss.detach().clone()))
        try:
            transformers.Trainer(model=model, args=args, train_dataset=Ragged(2 * steps), data_collator=pad_to_longest,
                                 callbacks=[callback] if callback else []).train()
        finally:
            hook.remove()
        return model, losses

    callback = StormCallback(budget=0.5, mode="embedded", min_bytes=0, clock=StillClock())
    settled: list[bool] = []
    callback.on_step_end = lambda *a, **k: settled.append(callback.handle.planner.settled)
    got = run(callback)
    assert settled[-1], callback.handle.explain()
    planner = callback.handle.planner
    assert planner.replans <= 1 and planner.trace.blocks[0].input_bytes >= 2 * 16 * 64 * 4, planner.explain()
    assert_same(run(None), got)


def test_a_train_that_raised_does_not_keep_the_next_from_enabling(tmp_path):
    """transformers calls no callback when train() raises: the next train begin disables what it left."""
    callback = StormCallback(mode="embedded", min_bytes=0)
    model = tiny_llama()
    calls = []

    def fail_second(m, args):
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("a failing step")

    hook = model.register_forward_pre_hook(fail_second)
    with pytest.raises(ZeroDivisionError):
        train(tmp_path, 3, callback, model)
    hook.remove()
    train(tmp_path, 2, callback, model)
    assert storm.enabled.handle_of(model) is None and not model._forward_hooks and not model._forward_pre_hooks


def test_a_new_callback_takes_off_what_a_train_that_raised_left(tmp_path):
    """A new Trainer with a new StormCallback on a model whose last train() raised: the handle the
    old callback left is disabled at train begin (it was refused: "storm.enable is already on ...
    call disable() on its handle first", with no handle in the user's hands)."""
    model = tiny_llama()

    class FailAtStepEnd(transformers.TrainerCallback):
        def on_step_end(self, *args, **kwargs) -> None:
            raise KeyError("a failing callback")

    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                                          logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    with pytest.raises(KeyError):
        transformers.Trainer(model=model, args=args, train_dataset=Tokens(4),
                             callbacks=[StormCallback(mode="embedded"), FailAtStepEnd()]).train()
    assert storm.enabled.handle_of(model) is not None  # no event of transformers' came to disable it
    callback = StormCallback(mode="embedded", min_bytes=0)
    train(tmp_path, 2, callback, model)
    assert storm.enabled.handle_of(model) is None and not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("options, error, message", [
    ({"mode": "bogus"}, ValueError, "mode must be one of"),
    ({"budegt": 0.5}, TypeError, "budegt"),
    ({"budget": 2.0}, ValueError, "budget must be bytes"),
    ({"budget": 0.5, "reentrant": "no"}, ValueError, "reentrant must be True or False"),
])
def test_bad_options_are_refused_when_the_callback_is_made(options, error, message):
    """As storm.enable refuses them, at the line that wrote them: they passed until train()."""
    with pytest.raises(error, match=message):
        StormCallback(**options)



def test_a_plan_of_wav2vec2_whose_encoder_drops_layers_settles_bit_identical():
    """Wav2Vec2's encoder drops each layer with a chance in training (LayerDrop, config.layerdrop,
    0.1 by default): steps that leave a layer out run the plan and are not read until it settles.
    Every step's gradients are those of the model without STORM, bit for bit."""
    import copy

    transformers.set_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        vocab_size=16, layerdrop=0.1, mask_time_prob=0.0)
    model = transformers.Wav2Vec2ForCTC(config).train()
    ref = copy.deepcopy(model)
    handle = storm.enable(model, budget=0.5, mode="embedded", min_bytes=0, clock=StillClock())
    assert handle.where == "wav2vec2.encoder.layers"
    g = torch.Generator().manual_seed(1)
    audio, labels = torch.randn(2, 1000, generator=g), torch.randint(1, 16, (2, 10), generator=g)
    try:
        for step in range(3 * SETTLE_STEPS):
            grads = []
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(step)  # the same layers dropped, and dropout masks, in both
                m(audio, labels=labels).loss.backward()
                grads.append([p.grad for p in m.parameters()])
            assert all(a is None and b is None or same_bits(a, b) for a, b in zip(*grads)), step
            if handle.planner.settled:
                break
        planner = handle.planner
        assert planner.settled and planner.replans == 0 and planner.smaller_steps > 0, planner.explain()
    finally:
        handle.disable()
