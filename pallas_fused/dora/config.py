"""The public `dora.Config`: one small frozen config per kernel family, and whether the merged weight is kept."""

from __future__ import annotations

import dataclasses

from pallas_fused.dora.kernel_columns import ColumnsConfig
from pallas_fused.dora.kernel_gemm import DX, FORWARD, EpilogueConfig, GemmConfig
from pallas_fused.dora.kernel_merge import MergeConfig
from pallas_fused.dora.kernel_norm import NormConfig, NormTiles
from pallas_fused.dora.kernel_sm90 import LayerTiles


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters of the DoRA Pallas kernels (advanced; GPU defaults, small inputs shrink the tiles).

    e.g. ``Config(merge=MergeConfig(bk=128), columns=ColumnsConfig(rows=1024))``.
    """

    norm: NormConfig = NormConfig()  # the column norm (kernel_norm)
    merge: MergeConfig = MergeConfig()  # the merge pass of "merged" (kernel_merge)
    forward: GemmConfig = FORWARD  # the fused-epilogue forward GEMM of "gemm" (kernel_gemm)
    dx: GemmConfig = DX  # the backward dx GEMM of "gemm"
    epilogue: EpilogueConfig = EpilogueConfig()  # the epilogue pass of "epilogue"
    columns: ColumnsConfig = ColumnsConfig()  # the backward column reductions (kernel_columns)
    # "merged": keep the merged weight from the forward for the backward's dx: one copy of W per layer in
    # the compute dtype held until the backward (Llama-7B: ~12.5 GB over 32 blocks in bf16). False: the backward
    # forms it again (one more pass over W: read W, write the copy). None: keep it for a dense W only (a quantised
    # W exists to save that memory).
    save_merged: bool | None = None
    # "sm90": the tiles of its two Mosaic GPU GEMMs (forward, dx). None: the tuned ones at the layer's shape
    # (`pallas_fused.tune`'s cache, the shipped table), else the rule's (`kernel_sm90.layer_tiles`).
    sm90: LayerTiles | None = None


DEFAULT = Config()

__all__ = ["ColumnsConfig", "Config", "EpilogueConfig", "GemmConfig", "MergeConfig", "NormConfig", "NormTiles"]
