"""Hugging Face models as benchmark workloads: an architecture of transformers built from a config
(random weights, no hub access) at generic sizes, trained on random tokens, as common.Llama is
for one Llama. bench/zoo.py measures the architectures listed here, each at two shapes; its
test trains their tiny CPU sizes bit-exact through a plan.

A script run as ``python bench/<name>.py`` has bench/ on its path and imports this as ``hf``.
Only plain config and model classes are used, those of transformers 5.17 (the lent GPU
machine's) as of later versions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from common import Shape
from storm.blocks import find_blocks


@dataclass(frozen=True)
class Arch:
    """One architecture: its transformers config and model classes, the config's keywords for a
    workload's sizes, how it is fed (``inputs``), the attention it runs, and what in it makes
    memory behave differently (``why``, for --list)."""

    config: str
    model: str
    inputs: str  # "causal": tokens as input_ids and labels; "seq2seq": other tokens as labels; "encoder": no head
    sizes: Callable[["HF"], dict]
    why: str
    attn: str = "sdpa"
    model_kwargs: tuple[tuple[str, object], ...] = ()


def _decoder(w: "HF") -> dict:
    """The keywords Llama-style configs share (their KV heads included)."""
    return {"vocab_size": w.vocab, "hidden_size": w.hidden, "intermediate_size": w.mlp, "num_hidden_layers": w.layers,
            "num_attention_heads": w.heads, "num_key_value_heads": w.kv_heads, "max_position_embeddings": w.seq}


ARCHS = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", "causal", _decoder, "the reference decoder: GQA, SwiGLU, RoPE"),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", "causal",
                    lambda w: {**_decoder(w), "sliding_window": w.window},
                    "sliding-window attention: the long shape's mask is a band, not the causal triangle"),
    # torch's SDPA has no soft-capping of the attention logits: transformers runs Gemma 2 eagerly,
    # saving each layer's (seq x seq) scores, and caps the 256k-vocabulary logits with a tanh
    "gemma2": Arch("Gemma2Config", "Gemma2ForCausalLM", "causal",
                   lambda w: {**_decoder(w), "head_dim": w.hidden // w.heads,
                              "query_pre_attn_scalar": w.hidden // w.heads, "sliding_window": w.window},
                   "logit soft-capping (eager attention: seq x seq scores saved), a 256k vocabulary: a large head",
                   attn="eager"),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", "causal",
                 lambda w: {**_decoder(w), "original_max_position_embeddings": w.seq, "pad_token_id": 0,
                            "bos_token_id": 1, "eos_token_id": 2},
                 "fused QKV and gate-up projections: fewer, larger saves per layer"),
    "gpt-neox": Arch("GPTNeoXConfig", "GPTNeoXForCausalLM", "causal",
                     lambda w: {k: v for k, v in _decoder(w).items() if k != "num_key_value_heads"},
                     "parallel residual: attention and MLP read the same normed input"),
    "mixtral": Arch("MixtralConfig", "MixtralForCausalLM", "causal",
                    lambda w: {**_decoder(w), "num_local_experts": w.experts, "num_experts_per_tok": 2},
                    "mixture of experts: each expert's saves are as large as the tokens routed to it, step by step"),
    "t5": Arch("T5Config", "T5ForConditionalGeneration", "seq2seq",
               lambda w: {"vocab_size": w.vocab, "d_model": w.hidden, "d_ff": w.mlp, "num_layers": w.layers,
                          "num_decoder_layers": w.layers, "num_heads": w.heads, "d_kv": w.hidden // w.heads,
                          "feed_forward_proj": "gated-gelu", "decoder_start_token_id": 0, "pad_token_id": 0},
               "encoder and decoder: two block lists, and a (heads x seq x seq) position bias shared by layers"),
    "bert": Arch("BertConfig", "BertModel", "encoder",
                 lambda w: {"vocab_size": w.vocab, "hidden_size": w.hidden, "intermediate_size": w.mlp,
                            "num_hidden_layers": w.layers, "num_attention_heads": w.heads,
                            "max_position_embeddings": w.seq},
                 "an encoder without an LM head (loss on the last hidden state), dropout on",
                 model_kwargs=(("add_pooling_layer", False),)),
}


@dataclass(frozen=True)
class HF(Shape):
    """A model of architecture ``arch`` (ARCHS) at these sizes, trained on random tokens: its loss
    (a language model's head and cross-entropy included) computed by ``forward``, inside the
    method's context. ``ckpt``: Hugging Face's own non-reentrant gradient checkpointing of every
    layer (both of T5's block lists). Its blocks are those storm.enable finds (find_blocks): T5's
    two lists planned as one."""

    arch: str
    window: int = 4096    # sliding window (Mistral, Gemma 2)
    experts: int = 8      # Mixtral
    dtype: str = "bfloat16"

    @property
    def spec(self) -> Arch:
        return ARCHS[self.arch]

    def config(self) -> object:
        import transformers  # the bench extra: the other workloads need none of it

        cfg = getattr(transformers, self.spec.config)(**self.spec.sizes(self), use_cache=False)
        cfg._attn_implementation = self.spec.attn
        return cfg

    def model(self, device: torch.device, seed: int = 0) -> nn.Module:
        """Built on ``device`` (a large model's random init on the host would take longer than its rows)."""
        import transformers

        torch.manual_seed(seed)
        with torch.device(device):
            model = getattr(transformers, self.spec.model)(self.config(), **dict(self.spec.model_kwargs))
        return model.to(getattr(torch, self.dtype)).train()

    def build(self, device: torch.device, ckpt: bool = False, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
        model = self.model(device, seed=seed)
        if ckpt:  # activation_checkpointing_enable: gradient_checkpointing_enable's newer name, where it has one
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # tokens from 1: T5's 0 is its padding and decoder start
        ids = torch.randint(1, self.vocab, (2, self.batch, self.seq), generator=torch.Generator().manual_seed(seed + 1))
        return model, ids.to(device) if self.spec.inputs == "seq2seq" else ids[0].to(device)

    @staticmethod
    def blocks(model: nn.Module) -> list[nn.Module]:
        """The blocks storm.enable plans over: those of every list of repeated layers that
        find_blocks finds, in the order forward runs them (T5: the encoder's, then the decoder's)."""
        return find_blocks(model).blocks

    def forward(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if self.spec.inputs == "seq2seq":
            return model(input_ids=ids[0], labels=ids[1]).loss
        if self.spec.inputs == "encoder":
            return model(input_ids=ids).last_hidden_state.float().square().mean()
        return model(input_ids=ids, labels=ids).loss

    @staticmethod
    def objective(loss: torch.Tensor) -> torch.Tensor:
        return loss


def tiny(arch: str, **sizes: int) -> HF:
    """``arch`` at a size that trains in milliseconds on the CPU, in float32: a test's."""
    base = HF(f"{arch}-tiny", arch=arch, layers=2, hidden=32, mlp=64, heads=4, kv_heads=2, vocab=128, batch=2, seq=16,
              window=8, experts=4, dtype="float32")
    return dataclasses.replace(base, **sizes)
