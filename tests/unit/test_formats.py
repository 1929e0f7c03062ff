"""Each table's storage format: bit widths follow the expected restores, small tables
stay fp32, and the quantization config names the field it rejects."""

from __future__ import annotations

import pytest

from torchrec_cnr import QuantizeConfig
from torchrec_cnr.encoding import FP32, Format, FormatResolver


def test_auto_bits_follow_expected_restores_and_fall_back_to_8_bits() -> None:
    for restores_expected, bits in ((1, 2), (3, 3), (20, 4), (21, 8)):
        config = QuantizeConfig(method="adaptive", bits="auto", expected_restores=restores_expected)
        assert FormatResolver(config, restores=0).resolve("t", 10_000) == Format("adaptive", bits)
    config = QuantizeConfig(method="adaptive", bits="auto", expected_restores=1)
    with pytest.warns(
        UserWarning,
        match="2 restores exceed quantize.expected_restores=1; checkpoints now use 8 bits",
    ):
        assert FormatResolver(config, restores=2).resolve("t", 10_000) == Format("adaptive", 8)


def test_small_tables_stay_fp32_unless_named() -> None:
    config = QuantizeConfig(method="kmeans", bits=3, min_rows=1000, tables={"tiny": "fp16"})
    resolver = FormatResolver(config, restores=0)
    assert resolver.resolve("ebc.small", 999) == FP32
    assert resolver.resolve("ebc.tiny", 10) == Format("fp16", 16)
    assert resolver.resolve("ebc.large", 5000) == Format("kmeans", 3)


def test_quantize_config_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="quantize. method must be one of"):
        QuantizeConfig(method="lossy")
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantizeConfig(bits=5)
    with pytest.raises(ValueError, match="quantize.tables entry 'adaptive:7'"):
        QuantizeConfig(tables={"t": "adaptive:7"})
    with pytest.raises(ValueError, match="quantize.optimizer_state"):
        QuantizeConfig(optimizer_state="int8")  # type: ignore[arg-type]
