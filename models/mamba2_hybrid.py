"""Mamba2's mixer beside attention (Falcon-H1, Granite 4.0-H): the config fields these families spell
`mamba_*` in config.json, the Mamba2Config they make, and the hybrid decoder whose state slots hold
the mixer's conv inputs and SSM state (models/mamba2.py has the mixer, models/hybrid.py the backbone)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from xlaserve.kernels.hybrid_cache import HybridCacheSpec
from xlaserve.models.config import TransformerConfig
from xlaserve.models.hybrid import HybridConfig, HybridDecoderLM, hybrid_cache_spec
from xlaserve.models.mamba2 import Mamba2Config, _read_float, group_copies


@dataclass(frozen=True)
class Mamba2HybridConfig(HybridConfig):
    """A hybrid whose recurrent mixer is Mamba2's: the mixer's fields as these families spell them in
    config.json (`mamba_*`), and the Mamba2Config they make (`mamba`)."""

    mamba_d_ssm: int = 0  # the mixer's width: config.json's, else mamba_expand * hidden_size
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_d_state: int = 0
    mamba_n_groups: int = 1
    mamba_group_copies: int = 1  # under tensor parallelism (Mamba2Config.group_copies)
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_gate_norm: str = "after_gate"
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        heads = hf.get("mamba_n_heads", 128)
        d_ssm = hf.get("mamba_d_ssm") or int(hf.get("mamba_expand", 2) * hf["hidden_size"])
        d_head = hf.get("mamba_d_head", "auto")
        limit = hf.get("time_step_limit") or (0.0, float("inf"))
        return {
            **super().fields_from_hf(hf),
            "mamba_d_ssm": d_ssm,
            "mamba_n_heads": heads,
            "mamba_d_head": d_ssm // heads if d_head == "auto" else d_head,
            "mamba_d_state": hf.get("mamba_d_state", 256),
            "mamba_n_groups": hf.get("mamba_n_groups", 1),
            "mamba_d_conv": hf.get("mamba_d_conv", 4),
            "mamba_chunk_size": hf.get("mamba_chunk_size", 256),
            "mamba_conv_bias": bool(hf.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(hf.get("mamba_proj_bias", False)),
            "time_step_limit": (_read_float(limit[0]), _read_float(limit[1])),
        }

    def for_tensor_parallel(self, tensor_parallel_size: int):
        return self.replace(mamba_group_copies=group_copies(self.mamba_n_groups, tensor_parallel_size))

    def checkpoint_rows(self, name: str, rows: int, checkpoint_config: Mamba2HybridConfig) -> int:
        return self.mamba.checkpoint_rows(name, rows, checkpoint_config.mamba)

    @property
    def mamba(self) -> Mamba2Config:
        """The Mamba2 mixer's config: the shared fields, with the SSM's heads and widths."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerConfig)}
        return Mamba2Config(
            **{
                **shared,
                "intermediate_size": self.mamba_d_ssm,
                "num_heads": self.mamba_n_heads,
                "num_kv_heads": self.mamba_n_heads,
                "head_dim": self.mamba_d_head,
                "partial_rotary_factor": 0.0,
            },
            state_size=self.mamba_d_state,
            n_groups=self.mamba_n_groups,
            group_copies=self.mamba_group_copies,
            conv_kernel=self.mamba_d_conv,
            chunk_size=self.mamba_chunk_size,
            use_conv_bias=self.mamba_conv_bias,
            use_bias=self.mamba_proj_bias,
            time_step_limit=self.time_step_limit,
            gate_norm=self.mamba_gate_norm,
        )


class Mamba2HybridLM(HybridDecoderLM):
    """The hybrid decoder whose state slots hold Mamba2's conv inputs and SSM state."""

    @classmethod
    def kv_cache_spec(cls, cfg: Mamba2HybridConfig) -> HybridCacheSpec:
        mamba = cfg.mamba
        return hybrid_cache_spec(
            cfg,
            conv_kernel=mamba.conv_kernel,
            conv_dim=mamba.conv_dim,
            recurrent_shape=(mamba.num_heads, mamba.head_dim, mamba.state_size),
        )
