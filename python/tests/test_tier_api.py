"""gmlake.tier's argument checking, without a GPU or torch (the GPU tests are in
tests/gpu/test_tier.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gmlake  # noqa: E402
import gmlake.tier as tier  # noqa: E402


def test_configure_arguments_are_checked():
    a = tier.check_configure_args()
    assert a == {
        "has_budget": 0,
        "budget": 0,
        "policy": "aware",
        "bandwidth": 0.0,
        "host_cache": 0,
        "prefetch_margin": -1,
        "tick_seconds": 0.0,
    }
    a = tier.check_configure_args(budget_bytes=1 << 30, policy="lru", bandwidth=20e9, prefetch_margin=2)
    assert (a["has_budget"], a["budget"], a["policy"], a["bandwidth"], a["prefetch_margin"]) == (
        1,
        1 << 30,
        "lru",
        20e9,
        2,
    )
    with pytest.raises(ValueError, match="policy"):
        tier.check_configure_args(policy="fifo")
    with pytest.raises(ValueError, match="budget_bytes"):
        tier.check_configure_args(budget_bytes=-1)
    with pytest.raises(TypeError, match="budget_bytes"):
        tier.check_configure_args(budget_bytes=1.5)
    with pytest.raises(TypeError, match="budget_bytes"):
        tier.check_configure_args(budget_bytes=True)
    with pytest.raises(ValueError, match="bandwidth"):
        tier.check_configure_args(bandwidth=0)
    with pytest.raises(ValueError, match="bandwidth"):
        tier.check_configure_args(bandwidth=float("inf"))
    with pytest.raises(TypeError, match="bandwidth"):
        tier.check_configure_args(bandwidth="fast")
    with pytest.raises(ValueError, match="host_cache_bytes"):
        tier.check_configure_args(host_cache_bytes=-5)
    with pytest.raises(ValueError, match="tick_seconds"):
        tier.check_configure_args(tick_seconds=-1e-3)


def test_configure_checks_before_needing_gmlake():
    with pytest.raises(ValueError, match="policy"):
        tier.configure(policy="mru")
    if not gmlake.is_enabled():
        with pytest.raises(RuntimeError, match="not enabled"):
            tier.configure(budget_bytes=1 << 20)


def test_handles_are_checked():
    with pytest.raises(TypeError, match="handle"):
        tier.get("7")
    with pytest.raises(TypeError, match="handle"):
        tier.free(True)
    with pytest.raises(ValueError, match="unknown handle 123456"):
        tier.get(123456)
    with pytest.raises(ValueError, match="unknown handle"):
        tier.free(123456)
    with pytest.raises(ValueError, match="unknown handle"):
        tier.state(99)


def test_advance_needs_a_non_negative_int():
    with pytest.raises(ValueError, match="now"):
        tier.advance(-1)
    with pytest.raises(TypeError, match="now"):
        tier.advance(1.0)


def test_put_checks_its_arguments_with_torch():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="torch.Tensor"):
        tier.put([1, 2, 3])
    with pytest.raises(ValueError, match="CUDA"):
        tier.put(torch.ones(4))
    with pytest.raises(TypeError, match="next_use"):
        tier.put(torch.ones(4), next_use="soon")
    with pytest.raises(ValueError, match="next_use"):
        tier.put(torch.ones(4), next_use=-2)


def test_offload_activations_checks_min_bytes():
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="min_bytes"):
        with tier.offload_activations(min_bytes=-1):
            pass


def test_package_exposes_tier():
    assert gmlake.tier is tier
    assert "tier" in gmlake.__all__
    for name in ("put", "get", "free", "configure", "stats", "offload_activations"):
        assert callable(getattr(tier, name))
