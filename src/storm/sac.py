"""A STORM plan in torch's own policy language: selective activation checkpointing (SAC).

torch.utils.checkpoint runs a region under a ``context_fn`` whose policy says, op by op, what
becomes of the op's output: saved for backward, recomputed in backward, or (CheckpointPolicy's
MUST_/PREFER_CPU_OFFLOAD, since torch 2.11) saved on the host. ``checkpoint_policy`` says per
block what a STORM plan decided for it, in that language (docs/graph.md, "torch's own policy
language", has what each torch version does with it)::

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, context_fn in enumerate(storm.checkpoint_policy(plan, blocks=len(model.layers))):
        if context_fn is not None:
            model.layers[i] = checkpoint_wrapper(model.layers[i], context_fn=context_fn)

What torch does with an offload policy (2.13 and 2.14 as their sources read, 2.11 by torch's history):

- eager: SAC keeps only the outputs tagged MUST_/PREFER_SAVE and replays every other op in
  backward, CPU_OFFLOAD included, so an offloaded block is recomputed; storm warns once.
  In eager, storm.offload or storm.plan offload a block's saves.
- compiled: the tag reaches the joint graph (``node.meta["recompute"]``) and nothing reads it:
  the partitioner treats the node as untagged, and torch's activation offloading
  (``torch._functorch.config.enable_activation_offloading``) moves only the saves marked
  ``node.meta["should_offload"]``, which no torch pass sets. ``offload_pass`` marks them::

      torch._functorch.config.enable_activation_offloading = True
      torch._functorch.config.joint_custom_pass = storm.sac.offload_pass()
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .options import bytes_option
from .planner.model import Plan
from .policy import DEFAULT_MIN_BYTES

log = logging.getLogger("storm")

CHOICES = ("offload", "recompute", "keep")
ContextFn = Callable[[], Any]  # what torch.utils.checkpoint.checkpoint takes as context_fn
_warned_eager = False


def _offload(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # PREFER: the partitioner chooses what to save, as it would without checkpointing, and what it
    # saves goes to the host. MUST_CPU_OFFLOAD bars recomputing any output, so the partitioner no
    # longer chooses (a Linear and GELU block then saves a GELU intermediate, not the GELU's input),
    # and torch's pull request for native SAC offload (#185015) fails a MUST it cannot offload,
    # falls back to saving on a PREFER. The same answer for every op: matmuls and attention are not
    # recomputed anyway (by default the partitioner bans recomputing ops outside its allowlist), and
    # a policy that read sizes from ctx.op_output would answer otherwise in a recompute, where the
    # torch versions that ask the policy again pass no output.
    return CheckpointPolicy.PREFER_CPU_OFFLOAD


def _recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # the whole block, as the plan's cost model counted it; torch: "a policy function that always
    # returns PREFER_RECOMPUTE is equivalent to vanilla checkpointing"
    return CheckpointPolicy.PREFER_RECOMPUTE


# Plain module functions: dynamo takes a function or functools.partial as context_fn, no other callable.
def _offload_context() -> Any:
    global _warned_eager
    if not torch.compiler.is_compiling() and not _warned_eager:
        _warned_eager = True
        log.warning("storm.checkpoint_policy: torch %s's eager selective checkpointing recomputes in backward "
                    "what a policy tags CPU_OFFLOAD, so the blocks the plan offloads are recomputed, not "
                    "offloaded; in eager, offload them with storm.offload or storm.plan, or compile the model "
                    "(docs/graph.md)", torch.__version__)
    return create_selective_checkpoint_contexts(_offload)


def _recompute_context() -> Any:
    return create_selective_checkpoint_contexts(_recompute)


def _choices(plan: Plan | Sequence[str], blocks: int | None) -> list[str]:
    if blocks is not None and (not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0):
        raise TypeError(f"storm.checkpoint_policy: blocks is the number of blocks, an int >= 0; got {blocks!r}")
    if not isinstance(plan, Plan) and (isinstance(plan, (str, bytes)) or not isinstance(plan, Sequence)):
        raise TypeError("storm.checkpoint_policy: plan is a storm Plan or a list of per-block choices "
                        f"(each one of {CHOICES}); got {type(plan).__name__} {plan!r}")
    if isinstance(plan, Plan):
        if blocks is None:
            raise TypeError("storm.checkpoint_policy: a Plan does not know how many blocks the model has; "
                            "pass blocks=len(the blocks it was planned for)")
        if any(not 0 <= i < blocks for i in plan.recomputed) or plan.offloaded > blocks:
            raise ValueError(f"storm.checkpoint_policy: the plan names blocks beyond the {blocks} given")
        # a recomputed block's input is the previous block's output: tagged for offload where that
        # block is offloaded; between two recomputed blocks torch's partitioner keeps it (MUST_SAVE)
        if plan.inputs_offloaded > (1 if plan.offloaded else 0):
            log.warning("storm.checkpoint_policy: the plan offloads the inputs of %d recomputed blocks; a "
                        "selective-checkpoint policy cannot tag a region's input, so only the first of them, "
                        "the last offloaded block's output, is offloaded", plan.inputs_offloaded)
        return ["offload" if i < plan.offloaded else "recompute" if i in plan.recomputed else "keep"
                for i in range(blocks)]
    choices = list(plan)
    wrong = sorted({repr(c) for c in choices if c not in CHOICES})
    if wrong:
        raise ValueError(f"storm.checkpoint_policy: a block's choice is one of {CHOICES}; got {', '.join(wrong)}")
    if blocks is not None and blocks != len(choices):
        raise ValueError(f"storm.checkpoint_policy: {len(choices)} choices for {blocks} blocks")
    return choices


def _need_cpu_offload(what: str) -> None:
    if not hasattr(CheckpointPolicy, "PREFER_CPU_OFFLOAD"):
        raise RuntimeError(f"{what} needs torch.utils.checkpoint.CheckpointPolicy.PREFER_CPU_OFFLOAD, which torch "
                           f"{torch.__version__} lacks (torch 2.11 and later have it); recompute or keep the blocks "
                           f"here, or offload them with storm.offload or storm.partitioner")


def checkpoint_policy(plan: Plan | Sequence[str], blocks: int | None = None) -> list[ContextFn | None]:
    """Per block, the ``context_fn`` for ``torch.utils.checkpoint.checkpoint(block, ...,
    use_reentrant=False, context_fn=...)`` that does what ``plan`` decided for the block, or None
    for a block to run without checkpointing.

    ``plan``: a storm Plan (``storm.plan(...).plan``, with ``blocks``, the number of blocks it was
    planned for), or one choice per block: "offload" (its saves go to the host: every op
    PREFER_CPU_OFFLOAD), "recompute" (every op PREFER_RECOMPUTE) or "keep" (None: checkpointing with
    MUST_SAVE on every op would save more than autograd does, and bar recomputes the compiler makes).
    Offloading takes a compiled model and ``offload_pass`` (this module's docstring)."""
    choices = _choices(plan, blocks)
    if "offload" in choices:
        _need_cpu_offload("storm.checkpoint_policy: offloading a block")
    contexts: dict[str, ContextFn | None] = {"offload": _offload_context, "recompute": _recompute_context,
                                             "keep": None}
    return [contexts[c] for c in choices]


def offload_pass(min_bytes: int | str = DEFAULT_MIN_BYTES) -> Callable[[torch.fx.GraphModule, Any],
                                                                       torch.fx.GraphModule]:
    """A ``torch._functorch.config.joint_custom_pass`` that hands torch's activation offloading
    (``enable_activation_offloading``) the saves a selective-checkpoint policy tagged CPU_OFFLOAD,
    those of at least ``min_bytes``. It runs on the joint graph before the partitioner: a node
    tagged MUST_CPU_OFFLOAD becomes MUST_SAVE (never recomputed, the one word the partitioner has
    for it); a PREFER one stays free. Of the nodes it marks, torch offloads those the partitioner
    saves, but for views, non-contiguous tensors and what forward returns (can_offload)."""
    _need_cpu_offload("storm.sac.offload_pass")
    limit = bytes_option("min_bytes", min_bytes)
    offload = {CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD}

    def mark(gm: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        for node in gm.graph.nodes:
            policy = node.meta.get("recompute")
            if policy not in offload:
                continue
            if policy is CheckpointPolicy.MUST_CPU_OFFLOAD:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                size = val.numel() * val.element_size()
                # of a symbolic shape the size is unknown until the graph runs: marked, as a large one
                if not isinstance(size, int) or size >= limit:
                    node.meta["should_offload"] = True
        return gm

    return mark
