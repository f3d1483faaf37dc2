"""Which saved tensors to offload, and why the others stay where they are."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from .errors import StormRequestError

log = logging.getLogger("storm")

DEFAULT_MIN_BYTES = 64 << 10  # below this the bookkeeping costs more than the bytes saved


class Keep:
    """Reasons a saved tensor stays where it is (the keys of OffloadStats.kept)."""

    PARAMETER = "parameter"        # alive anyway (the module holds it) and changed in place by the optimizer
    LEAF = "leaf requiring grad"   # a user input that requires grad: alive anyway, offloading frees nothing
    MODULE_STATE = "module state"  # a parameter or buffer of the modules passed as modules=
    SMALL = "below min_bytes"
    SUBCLASS = "tensor subclass"   # wrappers (DTensor, FakeTensor, ...) carry state beyond their storage
    LAYOUT = "not strided"         # sparse, mkldnn, nested: no single storage to copy
    DEVICE = "unsupported device"  # only cpu and cuda memory is copied
    LAZY_VIEW = "lazy conj/neg view"  # the conj/neg bit is not in the storage
    BUDGET = "over budget"         # the first save of a step past storm.offload(budget=...); later ones uncounted
    POOL_FULL = "pool full"        # the store had no room: the tensor stays, the step goes on
    QUOTA = "over quota"           # this client's share of the daemon's pool is used up
    STORE_ERROR = "store error"    # the store refused or went away: the tensor stays
    ROOM = "fits for backward"     # full offload: forward's last saves fit under the step's floor until their unpacks
    SHARED = "shared input"        # a block's input later blocks are called with too: alive until they are done
                                   # with it, so offloading it frees nothing (storm.plan: Offload.keep)


@dataclass(frozen=True)
class Policy:
    min_bytes: int = DEFAULT_MIN_BYTES
    protected: frozenset[int] = frozenset()  # storage addresses of module parameters and buffers

    @staticmethod
    def protecting(modules: tuple[nn.Module, ...] | None, min_bytes: int) -> "Policy":
        """Keeping the parameters and buffers of ``modules`` (storm.offload's modules=, as checked)."""
        if modules is None:
            return Policy(min_bytes)
        ptrs = {t.untyped_storage().data_ptr() for m in modules
                for t in [*m.parameters(), *m.buffers()] if t.numel()}
        return Policy(min_bytes, frozenset(ptrs))

    def keep_reason(self, t: torch.Tensor) -> str | None:
        """None when ``t`` should be offloaded, else the reason it stays.

        Called for every saved tensor on the training thread: exact type checks come
        first (``isinstance(t, Parameter)`` runs Python code in Parameter's metaclass)."""
        if type(t) is not torch.Tensor:
            return Keep.PARAMETER if isinstance(t, nn.Parameter) else Keep.SUBCLASS
        base = t._base
        if base is None:
            base = t
        elif type(base) is not torch.Tensor and isinstance(base, nn.Parameter):
            return Keep.PARAMETER
        if base.requires_grad and base.is_leaf:
            return Keep.LEAF
        if t.layout != torch.strided:
            return Keep.LAYOUT
        if t.device.type not in ("cpu", "cuda"):
            return Keep.DEVICE
        if t.is_conj() or t.is_neg() or t._is_zerotensor():
            return Keep.LAZY_VIEW
        if t.numel() * t.element_size() < self.min_bytes or t.untyped_storage().nbytes() == 0:
            return Keep.SMALL
        if self.protected and t.untyped_storage().data_ptr() in self.protected:
            return Keep.MODULE_STATE
        return None


# what a refusal means for the user, logged once per session and kind (%s: the store's reason)
_REFUSED = {
    Keep.POOL_FULL: "storm: the store's pool has no room for some saved tensors (%s): they stay on their device. "
                    "A larger pool takes them: storm.offload(pool_size=...) for the embedded store, stormd's "
                    "pool_size for a daemon; .stats.kept counts what stayed",
    Keep.QUOTA: "storm: this client's quota in stormd is used up: saved tensors stay on their device (%s). "
                "stormd's client_quota or clients table sets its bytes, client_max_keys its tensors",
    Keep.STORE_ERROR: "storm: saved tensors stay where they are while the store refuses them: %s",
}
_REFUSAL_CODES: dict[str | None, str] = {"POOL_FULL": Keep.POOL_FULL, "TOO_LARGE": Keep.POOL_FULL, "QUOTA": Keep.QUOTA}


class Refusals:
    """Why a put the store refused stays where it is; each kind of refusal is logged once per
    session, not once per tensor."""

    def __init__(self) -> None:
        self._warned: set[str] = set()  # kinds of refusal already logged

    def reason(self, err: BaseException) -> str:
        """The Keep reason for a put that failed with ``err``."""
        code = err.code if isinstance(err, StormRequestError) else None
        reason = _REFUSAL_CODES.get(code, Keep.STORE_ERROR)
        kind = f"{type(err).__name__}:{code}"
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(_REFUSED[reason], err)
        return reason
