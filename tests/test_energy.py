"""Energy counters: RAPL packages read from a powercap tree (wrap-around, subdomains,
unreadable counters) and NVML on a real NVIDIA driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.energy import EnergyMeter, energy_between, rapl_counters
from agent.sysmon import open_nvml


def _domain(root: Path, name: str, energy_uj: int, wrap_uj: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "energy_uj").write_text(f"{energy_uj}\n")
    (d / "max_energy_range_uj").write_text(f"{wrap_uj}\n")
    return d


def test_packages_are_read_and_subdomains_left_out(tmp_path: Path) -> None:
    _domain(tmp_path, "intel-rapl:0", 1_000, 10_000_000)
    _domain(tmp_path, "intel-rapl:1", 2_000, 10_000_000)
    _domain(tmp_path, "intel-rapl:0:0", 500, 10_000_000)  # core, inside package 0
    counters = rapl_counters(tmp_path)
    assert [c.energy.parent.name for c in counters] == ["intel-rapl:0", "intel-rapl:1"]


def test_an_evaluation_gets_the_energy_between_prepare_and_release(tmp_path: Path) -> None:
    p0 = _domain(tmp_path, "intel-rapl:0", 9_999_000, 9_999_999)
    p1 = _domain(tmp_path, "intel-rapl:1", 5_000, 9_999_999)
    meter = EnergyMeter(rapl=rapl_counters(tmp_path))
    meter.start("ev-a", "cpu")
    (p0 / "energy_uj").write_text("500000\n")  # wrapped: 1,000 + 500,000 µJ
    (p1 / "energy_uj").write_text("2005000\n")  # 2,000,000 µJ
    assert meter.stop("ev-a") == pytest.approx((1_000 + 500_000 + 2_000_000) / 1e6)
    assert meter.stop("ev-a") is None  # stopped once


def test_no_readable_counter_is_unknown_not_zero(tmp_path: Path) -> None:
    d = _domain(tmp_path, "intel-rapl:0", 1_000, 10_000)
    counters = rapl_counters(tmp_path)
    meter = EnergyMeter(rapl=counters)
    meter.start("ev-a", "cpu")
    (d / "energy_uj").write_text("not a number\n")
    assert meter.stop("ev-a") is None
    empty = EnergyMeter(rapl=[])
    empty.start("ev-b", "cpu")
    assert empty.stop("ev-b") is None
    assert EnergyMeter(rapl=counters, nvml=None).readings("cuda") is None


def test_a_counter_wraps_once_at_most() -> None:
    assert energy_between(10, 30, 100) == 20
    assert energy_between(90, 10, 99) == 20


@pytest.mark.gpu
def test_nvml_energy_of_a_gpu_run() -> None:
    nvml = open_nvml()
    if nvml is None or not nvml.nvmlDeviceGetCount():
        pytest.skip("no NVIDIA driver or GPU")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    meter = EnergyMeter(rapl=[], nvml=nvml)
    meter.start("ev-gpu", "cuda")
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(200):
        x = x @ x
        x = x / x.norm()
    torch.cuda.synchronize()
    joules = meter.stop("ev-gpu")
    assert joules is not None and joules > 0
