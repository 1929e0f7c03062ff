"""Each table's storage format: fp32, a cast, or a quantizer at a bit width.

Check-N-Run (NSDI'22, Sec. 4.4) picks the bit width from the number of restores a
checkpoint is expected to serve, and falls back to 8 bits once restores exceed that.
"""

from __future__ import annotations

import warnings

from torchrec_cnr.config import QuantizeConfig
from torchrec_cnr.quantization import CAST_METHODS, select_bits
from torchrec_cnr.schema import FP32, Format

__all__ = ["FP32", "Format", "FormatResolver"]


class FormatResolver:
    """Chooses each table's storage format from the config and the restores so far.

    Args:
        config: the quantization settings.
        restores: restores recorded in the manifest; once they exceed
            ``expected_restores``, ``bits="auto"`` falls back to 8 bits.
    """

    def __init__(self, config: QuantizeConfig, restores: int) -> None:
        self.config = config
        self.restores = restores
        self._warned = False

    def _auto_bits(self) -> int:
        if self.restores > self.config.expected_restores:
            if not self._warned:
                warnings.warn(
                    f"{self.restores} restores exceed quantize.expected_restores="
                    f"{self.config.expected_restores}; checkpoints now use 8 bits",
                    stacklevel=3,
                )
                self._warned = True
            return 8
        pairs = [(p[0], p[1]) for p in self.config.thresholds]
        return select_bits(self.config.expected_restores, pairs)

    def resolve(self, table: str, num_rows: int) -> Format:
        """The format of ``table`` (qualified name), which has ``num_rows`` rows in all."""
        method, bits = self.config.table_format(table, num_rows)
        if method == "none":
            return FP32
        if method in CAST_METHODS:
            return Format(method, 16)
        return Format(method, self._auto_bits() if bits == "auto" else int(bits))
