"""explain() on models unlike the GPT the other tests train: a ResNet-style CNN, a UNet and an
encoder-decoder transformer name the modules that saved what outside their blocks; a plan not
yet settled says what its next step does; a trial's line and the recompute form's agree on
what was kept."""

from __future__ import annotations

import re
from typing import Callable

import pytest
import torch
from torch import nn

import storm
from planner_fakes import FakeClock, ScriptedMemory, recompute_two
from storm.planner import Phase, Plan, Scenario, predicted_peak
from storm.planner.trial import TRIAL_MAX_STEPS


class Residual(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    """A ResNet's shape: a stem (conv, BatchNorm, ReLU, max-pool), residual blocks, a pooled head."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(2)
        self.layers = nn.Sequential(*(Residual(c) for _ in range(3)))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.maxpool(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(self.avgpool(x).flatten(1))


class Down(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv, self.pool = nn.Conv2d(c, c, 3, padding=1), nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.conv(x)))


class Up(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(2 * c, c, 1)  # under a quarter of the Downs: storm.enable plans the encoder alone

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = nn.functional.interpolate(x, scale_factor=2.0)
        return torch.relu(self.conv(torch.cat([x, skip], 1)))


class UNet(nn.Module):
    """An encoder of repeated blocks (the blocks), a decoder of modules each called with an
    encoder block's input, and a head: the decoder saves more than the encoder."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.inc = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.ModuleList(Down(c) for _ in range(3))
        self.decoder = nn.ModuleDict({"up1": Up(c), "up2": Up(c)})
        self.head = nn.Sequential(nn.BatchNorm2d(c), nn.Conv2d(c, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, skips = self.inc(x), []
        for block in self.down:
            skips.append(x)
            x = block(x)
        x = nn.functional.interpolate(x, scale_factor=2.0)  # to the last skip's size, in the model's own code
        x = self.decoder["up1"](x, skips[-2])
        x = self.decoder["up2"](x, skips[-3])
        return torch.sigmoid(self.head(x))  # its output saved by the model's own code


class Seq2Seq(nn.Module):
    """An encoder-decoder transformer: embeddings, an encoder, a decoder whose layers (larger than
    the encoder's, for their cross-attention) are the blocks, given as blocks= (storm.enable would
    plan the encoder's layers too), and a head."""

    def __init__(self, d: int = 32, vocab: int = 64):
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(vocab, d), nn.Embedding(vocab, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True), 2,
                                             enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 2, 64, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.src_embed(ids))
        return self.head(self.decoder(self.tgt_embed(ids.roll(1, 1)), memory))


def planned(model: nn.Module, x: torch.Tensor, **options) -> storm.Enabled:
    """``model`` enabled with a plan of half its saves, past its two traced steps and planned."""
    torch.manual_seed(0)
    handle = storm.enable(model, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock(), **options)
    for _ in range(2):
        model(x).float().square().mean().backward()
    assert not handle.planner.settled and handle.planner.plan is not None  # the traces read, the plan made
    return handle


def outside_lines(text: str) -> tuple[str, str]:
    lines = text.splitlines()
    before, after = (next(line for line in lines if line.startswith(f"{side} the blocks: "))
                     for side in ("before", "after"))
    return before, after


def named(line: str) -> dict[str, int]:
    """The modules a line of explain() names, with their KiB (the tiny models' saves are under 1 MiB)."""
    saved = line.split("; ")[0]  # not what the plan does with it
    return {name: int(kib) for name, kib in re.findall(r"([\w.]+(?: \(own code\))?) (\d+) KiB", saved)}


@pytest.mark.parametrize("make, x, before, after, blocks", [
    (ResNet, torch.randn(2, 3, 16, 16), {"conv1", "bn1", "relu", "maxpool"}, {"fc"}, None),
    (UNet, torch.randn(2, 3, 32, 32), {"inc"}, {"decoder.up1", "decoder.up2", "head", "UNet (own code)"}, None),
    (Seq2Seq, torch.randint(0, 64, (2, 16)), {"encoder", "src_embed", "tgt_embed"}, {"head"}, "decoder.layers"),
], ids=["resnet", "unet", "seq2seq"])
def test_explain_names_the_modules_that_saved_outside_the_blocks(make, x, before, after, blocks):
    """Each save outside the blocks counts for the outermost module that holds no block, by the
    model's own name for it (a UNet's decoder modules, a transformer's encoder), and what the
    model's forward saved outside any module as its own code; no words of a language model's."""
    torch.manual_seed(0)
    model = make()
    handle = planned(model, x, **({"blocks": model.get_submodule(blocks)} if blocks else {}))
    t, text = handle.planner.trace, handle.explain()
    for word in ("embeddings", "final norm", "logits", "loss"):
        assert word not in text, text
    lines = outside_lines(text)
    assert before <= named(lines[0]).keys() and after <= named(lines[1]).keys(), text
    assert not named(lines[0]).keys() & named(lines[1]).keys(), text
    # every byte outside the blocks is some module's
    assert sum(b for _, b in t.before_modules) == t.before_bytes > 0
    assert sum(b for _, b in t.after_modules) == t.after_bytes > 0
    handle.disable()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # the trace's came off


def test_the_unet_decoder_is_named_after_the_blocks_with_its_bytes():
    """The UNet's decoder saves most of what lies outside its blocks: its modules named with their
    bytes, the largest first, a module called inside another counted for the outer one (the
    decoder's convs for decoder.up1 and decoder.up2, the head's for head)."""
    model = UNet()
    handle = planned(model, torch.randn(2, 3, 32, 32))
    t = handle.planner.trace
    assert [name for name, _ in t.after_modules] == ["decoder.up2", "head", "decoder.up1", "UNet (own code)"]
    _, after = outside_lines(handle.explain())
    assert after.startswith(f"after the blocks: {t.after_bytes // 1024} KiB saved by decoder.up2 96 KiB, head 32 KiB, "
                            f"decoder.up1 24 KiB, UNet (own code) 16 KiB; "), after
    handle.disable()


def test_without_the_model_the_bytes_are_told_and_nothing_named():
    model = ResNet()
    x = torch.randn(2, 3, 16, 16)
    planner = storm.plan(list(model.layers), budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock())
    for _ in range(2):
        with planner.step():
            loss = model(x).square().mean()
        loss.backward()
    assert not planner.settled
    before, _ = outside_lines(planner.explain())
    assert "model= names the modules" in before and not planner.trace.before_modules
    planner.close()


def status(planner: storm.Planner) -> str:
    return planner.explain().splitlines()[1]


def resnet_planner(**options) -> tuple[Callable[[], None], storm.Planner]:
    """A storm.Planner on the ResNet's blocks and what runs one step of it."""
    torch.manual_seed(0)
    model, x = ResNet(), torch.randn(2, 3, 16, 16)
    planner = storm.Planner(list(model.layers), mode="embedded", min_bytes=0, **options)

    def step() -> None:
        with planner.step():
            loss = model(x).square().mean()
        loss.backward()

    return step, planner


def test_an_unsettled_plan_says_what_its_next_step_does_and_a_settled_one_says_settled():
    """The planner's phase, in words, from the plan's first step to its settling: the peak measured
    against the target, the host time of the packs read, a trial of the two kinds of plan; then
    settled."""
    def offload_or_recompute(s: Scenario) -> Plan:
        trace = s.trace
        if s.offload is False:
            every = frozenset(range(3))
            return Plan(offloaded=0, recomputed=every, offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                        predicted_peak=predicted_peak(trace, 0, every, 0), predicted_cost_ms=1.0, fits=True)
        return Plan(offloaded=2, recomputed=frozenset(), offload_budget=trace.offloaded_before[2],
                    max_held_bytes=1 << 30, prefetch_bytes=0, predicted_peak=predicted_peak(trace, 2, set(), 0),
                    predicted_cost_ms=0.0, fits=True)

    memory = ScriptedMemory(extra=0)
    step, planner = resnet_planner(budget=0.9, memory=memory, chooser=offload_or_recompute, clock=FakeClock(),
                                   host_check_tolerance=float("inf"))
    memory.planner = planner
    unplanned, seen = planner.explain(), {}
    for _ in range(40):
        if planner.settled:  # read between steps, as the next step would
            break
        if planner.plan is not None:
            seen.setdefault(planner.phase, status(planner))
        step()
    assert status(planner) == ("settled: no further step measures, tries or changes this plan while steps run as "
                               "the traced one did, or on smaller inputs")
    assert seen.keys() == {Phase.MEASURE, Phase.CHECK_HOST, Phase.TRY}
    assert seen[Phase.MEASURE].startswith("not settled yet: the next step measures its peak against the target of ")
    assert seen[Phase.CHECK_HOST].startswith("not settled yet: a coming step that offloads has its host time per "
                                             "offloaded tensor read")
    assert seen[Phase.TRY].startswith("not settled yet: trying offload 2 blocks against recompute 3 blocks in "
                                      "alternation")
    assert unplanned == "storm.plan: no plan yet; the next step is traced with every save offloaded (what each " \
                        "block saves)"
    planner.close()


def form_trial(ms: Callable[[int, bool], float], looking: Callable[[storm.Planner], None] = lambda p: None
               ) -> storm.Planner:
    """The ResNet's planner whose plan recomputes blocks 0 and 1, through its trial of the two
    recompute forms, the k-th trial step taking ``ms(k, reentrant)``; ``looking`` is called
    between steps."""
    clock, timed = FakeClock(), []
    step, planner = resnet_planner(budget=0.5, clock=clock, chooser=recompute_two)

    def given(start, end):
        if planner.phase is not Phase.TRY:  # the compute trace's
            return FakeClock.elapsed_ms(clock, start, end)
        timed.append(ms(len(timed), planner.plan.reentrant))
        return timed[-1]

    clock.elapsed_ms = given
    while not planner.settled:
        assert len(timed) <= 2 * TRIAL_MAX_STEPS, planner.explain()
        step()
        planner.settled  # reads the step
        looking(planner)
    return planner


def test_while_the_forms_are_tried_explain_says_so_and_claims_no_winner():
    """Between the trial's steps the plan in force alternates: the form line says it is being
    tried, never that the form in force was faster."""
    looked = []

    def look(planner: storm.Planner) -> None:
        if planner.phase is Phase.TRY:
            lines = planner.explain().splitlines()
            looked.append((next(line for line in lines if line.startswith("recomputed ")), lines[1]))

    form_trial(lambda k, reentrant: 100.0 if reentrant else 110.0, look)
    forms = [form for form, _ in looked]
    assert not [form for form in forms if "faster" in form], forms
    assert {form.split(" in the last step")[0] for form in forms} == {
        "recomputed in the reentrant form (storm.recompute)", "recomputed with torch's non-reentrant checkpoint"}
    assert all(form.endswith("the two forms are being tried (above)") for form in forms), forms
    assert all(line.startswith("not settled yet: trying the reentrant form against torch's non-reentrant checkpoint "
                               "to recompute 2 blocks in alternation") for _, line in looked), looked


def test_the_trial_line_and_the_form_line_agree_on_the_reentrant_form_kept():
    """The reentrant form's steps took less, each by 69.35 ms: both lines say it was kept, the
    times to 0.1 ms, and nothing says the non-reentrant form was faster."""
    planner = form_trial(lambda k, reentrant: 494.62 if reentrant else 563.97)
    text = planner.explain()
    assert planner.plan.reentrant
    assert ("tried the reentrant form against torch's non-reentrant checkpoint to recompute 2 blocks in "
            "alternation, 5 steps each, forward and backward timed: median step 494.6 against 564.0 ms; kept "
            "the reentrant form, 69.4 ms a step faster in the median of the 5 pairs of steps run one after the "
            "other") in text.splitlines()
    assert ("recomputed in the reentrant form (storm.recompute), kept in its trial against the other form: "
            "faster there") in text.splitlines()
    assert "non-reentrant checkpoint, faster" not in text and "non-reentrant checkpoint was" not in text


def test_a_trial_kept_by_its_pairs_of_steps_against_its_medians_says_why():
    """A slow stretch of the host from the sixth step on makes the non-reentrant form's median
    step the longer, while each of its steps took 3 ms less than the reentrant step before it:
    it is kept, and the line says its median is the longer one and why."""
    planner = form_trial(lambda k, reentrant: (100.0 if reentrant else 97.0) + 40.0 * (k >= 5))
    text = planner.explain()
    assert not planner.plan.reentrant
    trial = next(line for line in text.splitlines() if line.startswith("tried "))
    assert "median step 100.0 against 137.0 ms; kept torch's non-reentrant checkpoint, 3.0 ms a step faster" in trial
    assert trial.endswith("(its median step is the longer: the pairs decide, which a slow stretch of the host "
                          "moves less)")
    assert ("recomputed with torch's non-reentrant checkpoint, kept in its trial against the other form: faster "
            "there") in text.splitlines()
