"""Topology detection (SPEC F11): the ``nvidia-smi topo -m`` parser, the CPU fallback, and the NVML
and nvidia-smi paths with faked drivers.

The matrices under ``tests/comm/data/nvidia_smi_topo_*.txt`` are hand-written samples in the documented
format of ``nvidia-smi topo -m`` (tab-separated header of GPU, NIC and affinity columns; an ``X``
diagonal; the legend after the matrix), not captures from real machines; their first line says so.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from ops_transformer.comm import topology as topo
from ops_transformer.comm.topology import Topology, detect_topology, parse_nvidia_smi_topo

DATA = Path(__file__).parent / "data"


def _sample(name: str) -> str:
    return (DATA / f"nvidia_smi_topo_{name}.txt").read_text()


def test_parse_dgx_a100_ignores_nics_affinity_and_legend():
    m = parse_nvidia_smi_topo(_sample("dgx_a100"))
    assert len(m) == 8 and all(len(row) == 8 for row in m)
    assert all(m[i][i] == "self" for i in range(8))
    assert {m[i][j] for i in range(8) for j in range(8) if i != j} == {"nvlink:12"}


def test_parse_pcie_box_with_ansi_header():
    m = parse_nvidia_smi_topo(_sample("pcie_4gpu"))
    assert m == [["self", "pcie-host", "sys", "sys"],
                 ["pcie-host", "self", "sys", "sys"],
                 ["sys", "sys", "self", "pcie-host"],
                 ["sys", "sys", "pcie-host", "self"]]


def test_parse_two_gpus_nv4():
    assert parse_nvidia_smi_topo(_sample("nv4_2gpu")) == [["self", "nvlink:4"],
                                                           ["nvlink:4", "self"]]


def test_parse_pix_pxb_and_a_single_gpu():
    text = "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tPIX\tPXB\t0-7\n" \
           "GPU1\tPIX\t X \tSOC\t0-7\nGPU2\tPXB\tSOC\t X \t0-7\n"
    assert parse_nvidia_smi_topo(text)[0] == ["self", "pcie-switch", "pcie-switch"]
    assert parse_nvidia_smi_topo(text)[1][2] == "sys"
    assert parse_nvidia_smi_topo("\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-7\tN/A\n") \
        == [["self"]]


@pytest.mark.parametrize("text,needle", [
    ("", "no header row"),
    ("No devices were found\n", "no header row"),
    ("\tGPU0\tGPU1\tCPU Affinity\n", "no row for GPU0, GPU1"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n", "no row for GPU1"),
    ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV4\t X \n",
     "row GPU0 has 1 cells, fewer than the 2 GPUs"),
    ("\tGPU0\tGPU1\nGPU0\t X \tQPI\nGPU1\tQPI\t X \n",
     "unknown link 'QPI' in row GPU0, column GPU1"),
    ("\tGPU0\tGPU1\nGPU0\tNV4\tX\nGPU1\tNV4\t X \n", "row GPU0: the diagonal cell is 'NV4'"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n", "row GPU0 appears twice"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \nGPU2\tNV4\tNV4\t X \n",
     "row GPU2 but the header names only 2 GPUs"),
])
def test_parse_malformed_input_raises_a_clear_error(text, needle):
    with pytest.raises(ValueError) as info:
        parse_nvidia_smi_topo(text)
    assert needle in str(info.value)


def test_topology_helpers():
    nv = Topology("gpu", 2, 2, [["self", "nvlink:18"], ["nvlink:18", "self"]], "nvml",
                  "NVIDIA H100 80GB HBM3", 5)
    assert nv.all_nvlink() and nv.intra_link_name() == "nvlink4"
    assert Topology("gpu", 2, 2, nv.link_matrix, "nvml").intra_link_name() == "nvlink"
    pcie = Topology("gpu", 2, 2, [["self", "sys"], ["sys", "self"]], "nvml", "NVIDIA L40S", 4)
    assert not pcie.all_nvlink() and pcie.intra_link_name() == "pcie4"
    mixed = Topology("gpu", 3, 3, [["self", "nvlink:4", "sys"], ["nvlink:4", "self", "sys"],
                                   ["sys", "sys", "self"]], "nvidia-smi")
    assert not mixed.all_nvlink() and mixed.intra_link_name() == "pcie"
    one = Topology("gpu", 1, 1, [["self"]], "nvml", "NVIDIA A100-SXM4-80GB")
    assert not one.all_nvlink() and one.intra_link_name() == "none"
    d = nv.to_dict()
    assert d["all_nvlink"] and d["intra_link"] == "nvlink4"
    assert d["link_matrix"][0][1] == "nvlink:18"
    assert "link_matrix" not in nv.to_dict(with_matrix=False)


def _no_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError


def test_cpu_fallback_without_nvml_or_nvidia_smi(monkeypatch):
    _no_nvml(monkeypatch)
    monkeypatch.setattr(topo.shutil, "which", lambda name: None)
    t = detect_topology()
    assert (t.kind, t.source, t.intra_link_name()) == ("cpu", "cpu", "loopback")
    assert t.devices == t.ranks_per_node >= 1 and not t.all_nvlink()
    assert t.link_matrix[0][0] == "self" and all(len(r) == t.devices for r in t.link_matrix)
    if t.devices > 1:
        assert t.link_matrix[0][1] == "loopback"


def test_detect_on_this_machine_never_crashes():
    t = detect_topology()
    assert t.kind in ("gpu", "cpu") and t.devices >= 1


def test_nvidia_smi_path_with_a_faked_binary(monkeypatch):
    _no_nvml(monkeypatch)
    monkeypatch.setattr(topo.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv)
        out = _sample("dgx_a100") if argv[1:] == ["topo", "-m"] else \
            "NVIDIA A100-SXM4-80GB, 4\n" * 8
        return subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")

    monkeypatch.setattr(topo.subprocess, "run", fake_run)
    t = detect_topology()
    assert (t.kind, t.source, t.devices, t.ranks_per_node) == ("gpu", "nvidia-smi", 8, 8)
    assert t.all_nvlink() and t.intra_link_name() == "nvlink3" and t.pcie_generation == 4
    assert calls[0][1:] == ["topo", "-m"]


def test_nvidia_smi_failure_falls_back_to_cpu(monkeypatch):
    _no_nvml(monkeypatch)
    monkeypatch.setattr(topo.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(topo.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(
        argv, 9, stdout="", stderr="NVIDIA-SMI has failed because it couldn't communicate"))
    assert detect_topology().source == "cpu"


def _fake_pynvml(n: int, nvlinks: dict[tuple[int, int], int], levels: dict,
                 p2p: set | None = None) -> types.ModuleType:
    """A stand-in for ``pynvml``: ``nvlinks[(i, j)]`` links from GPU i end at device j (a GPU, or
    an NVSwitch when ``j >= n``); ``p2p`` the pairs that can talk over NVLink (default: the keys
    of ``nvlinks``)."""
    p2p = set(nvlinks) if p2p is None else p2p
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def links_of(i):
        return [j for (a, j), k in sorted(nvlinks.items()) if a == i for _ in range(k)]

    def remote(h, link):
        ends = links_of(h)
        if link >= len(ends):
            raise NVMLError("invalid argument")
        return types.SimpleNamespace(busId=f"0000:{ends[link]:02x}:00.0")

    m.NVMLError, m.NVML_NVLINK_MAX_LINKS, m.NVML_FEATURE_ENABLED = NVMLError, 18, 1
    m.NVML_P2P_CAPS_INDEX_NVLINK, m.NVML_P2P_STATUS_OK = 3, 0
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: n
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"0000:{h:02x}:00.0")
    m.nvmlDeviceGetNvLinkState = lambda h, link: 1 if link < len(links_of(h)) else \
        (_ for _ in ()).throw(NVMLError("invalid argument"))
    m.nvmlDeviceGetNvLinkRemotePciInfo = remote
    m.nvmlDeviceGetP2PStatus = lambda a, b, idx: 0 if (a, b) in p2p else 5
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: levels[frozenset((a, b))]
    return m


def test_nvml_path_with_a_faked_library(monkeypatch):
    nvlinks = {(0, 1): 4, (1, 0): 4}
    levels = {frozenset((0, 2)): 30, frozenset((1, 2)): 50, frozenset((0, 1)): 10}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(3, nvlinks, levels))
    t = detect_topology()
    assert (t.source, t.devices, t.gpu_name, t.pcie_generation) == \
        ("nvml", 3, "NVIDIA H100 80GB HBM3", 5)
    assert t.link_matrix == [["self", "nvlink:4", "pcie-host"], ["nvlink:4", "self", "sys"],
                             ["pcie-host", "sys", "self"]]
    assert not t.all_nvlink() and t.intra_link_name() == "pcie5"


def test_nvml_links_through_nvswitch(monkeypatch):
    nvlinks = {(i, 0x80 + k): 3 for i in range(4) for k in range(6)}  # 18 links to 6 switches
    p2p = {(i, j) for i in range(4) for j in range(4) if i != j}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(4, nvlinks, {}, p2p))
    t = detect_topology()
    assert {t.link_matrix[i][j] for (i, j) in p2p} == {"nvlink:18"}
    assert t.all_nvlink() and t.intra_link_name() == "nvlink4"


def test_nvml_without_gpus_falls_through(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(0, {}, {}))
    monkeypatch.setattr(topo.shutil, "which", lambda name: None)
    assert detect_topology().source == "cpu"
