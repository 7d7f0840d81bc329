"""What connects the devices of this node (SPEC F11): NVLink or PCIe between GPU pairs, or loopback.

Detection tries, in order: NVML through ``pynvml`` (the ``nvidia-ml-py`` package), then the matrix
printed by ``nvidia-smi topo -m``, then the CPU case (local processes over loopback). It never fails
on a machine without GPUs. Only this node is described: ranks on other nodes are reached over the
inter-node network, which the planner's cluster spec names.

Link kinds, one per ordered GPU pair (``link_matrix[i][j]``), from the ``nvidia-smi`` legend:

================= ================= ===========================================================
``nvidia-smi``    kind              meaning
================= ================= ===========================================================
``X``             ``self``          the device itself
``NV#``           ``nvlink:#``      a bonded set of ``#`` NVLinks (directly or via NVSwitch)
``PIX``/``PXB``   ``pcie-switch``   one or more PCIe bridges, no host bridge
``PHB``/``NODE``  ``pcie-host``     a PCIe host bridge, or host bridges within one NUMA node
``SYS``/``SOC``   ``sys``           the SMP interconnect between NUMA nodes (QPI/UPI)
================= ================= ===========================================================
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"GPU(\d+)$")
_CELL_KINDS = {"X": "self", "PIX": "pcie-switch", "PXB": "pcie-switch", "PHB": "pcie-host",
               "NODE": "pcie-host", "SYS": "sys", "SOC": "sys"}
# NVML topology levels (nvmlGpuTopologyLevel_t) -> link kind
_NVML_LEVELS = {0: "self", 10: "pcie-switch", 20: "pcie-switch", 30: "pcie-host", 40: "pcie-host",
                50: "sys"}
# Best guess of the NVLink generation from the GPU's name (NVIDIA datasheets).
_NVLINK_GENERATION = (("GB200", 5), ("B200", 5), ("B100", 5), ("H100", 4), ("H200", 4),
                      ("H800", 4), ("GH200", 4), ("A100", 3), ("A800", 3), ("A30", 3),
                      ("A40", 3), ("A6000", 3), ("3090", 3), ("V100", 2), ("P100", 1))
_SUBPROCESS_TIMEOUT_S = 20


@dataclass(frozen=True)
class Topology:
    """The devices of this node and the link between each pair.

    ``kind`` is ``"gpu"`` or ``"cpu"``; ``devices`` the GPUs (or CPU cores) of this node;
    ``ranks_per_node`` the local ranks a job would place here (one per device);
    ``link_matrix[i][j]`` the link kind between devices ``i`` and ``j`` (module docstring);
    ``source`` where it came from: ``"nvml"``, ``"nvidia-smi"`` or ``"cpu"``.
    """

    kind: str
    devices: int
    ranks_per_node: int
    link_matrix: list[list[str]]
    source: str
    gpu_name: str = ""
    pcie_generation: int | None = None

    def pairs(self) -> list[str]:
        """The link kinds of every pair ``i < j``."""
        n = len(self.link_matrix)
        return [self.link_matrix[i][j] for i in range(n) for j in range(i + 1, n)]

    def all_nvlink(self) -> bool:
        """Whether every pair of GPUs is joined by NVLink (``False`` with fewer than two GPUs)."""
        pairs = self.pairs()
        return self.kind == "gpu" and bool(pairs) and all(p.startswith("nvlink") for p in pairs)

    def intra_link_name(self) -> str:
        """A best guess of the slowest intra-node link in catalogue terms: ``"nvlink4"``,
        ``"pcie4"``, ``"loopback"`` (CPU), ``"none"`` (one GPU); the generation is left out
        (``"nvlink"``, ``"pcie"``) when it cannot be told."""
        if self.kind == "cpu":
            return "loopback"
        if not self.pairs():
            return "none"
        if self.all_nvlink():
            gen = next((g for key, g in _NVLINK_GENERATION if key in self.gpu_name.upper()), None)
            return f"nvlink{gen}" if gen else "nvlink"
        return f"pcie{self.pcie_generation}" if self.pcie_generation else "pcie"

    def to_dict(self, with_matrix: bool = True) -> dict:
        data = asdict(self)
        if not with_matrix:
            del data["link_matrix"]
        data.update(all_nvlink=self.all_nvlink(), intra_link=self.intra_link_name())
        return data


def _cell_kind(cell: str, where: str) -> str:
    if cell in _CELL_KINDS:
        return _CELL_KINDS[cell]
    match = re.fullmatch(r"NV(\d+)", cell)
    if match:
        return f"nvlink:{int(match.group(1))}"
    raise ValueError(f"unknown link {cell!r} in {where} of the nvidia-smi topology matrix "
                     f"(expected X, NV#, PIX, PXB, PHB, NODE or SYS)")


def _is_row(cells: list[str]) -> bool:
    """``GPUi`` followed by a link cell (a header has ``GPU0`` followed by a column name)."""
    return (len(cells) > 1 and bool(_GPU.match(cells[0]))
            and (cells[1] in _CELL_KINDS or bool(re.fullmatch(r"NV\d+", cells[1]))))


def parse_nvidia_smi_topo(text: str) -> list[list[str]]:
    """The GPU × GPU link kinds of the matrix printed by ``nvidia-smi topo -m``.

    The header row names the columns (``GPU0 … GPUn-1``, then NICs, ``CPU Affinity``, ``NUMA
    Affinity`` …); each ``GPUi`` row starts with its name and holds one cell per column. Only the
    GPU columns are read; NIC rows, text before the header and the legend after the matrix are
    ignored. Raises ``ValueError`` naming what is missing or not understood.
    """
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header = next((i for i, line in enumerate(lines)
                   if line.split()[:1] == ["GPU0"] and not _is_row(line.split())), None)
    if header is None:
        raise ValueError("no header row ('\\tGPU0\\tGPU1 …') in the nvidia-smi topo -m output")
    columns = lines[header].split()
    n = next((k for k, name in enumerate(columns) if name != f"GPU{k}"), len(columns))
    rows: dict[int, list[str]] = {}
    for line in lines[header + 1:]:
        cells = line.split()
        if not cells or not _GPU.match(cells[0]):
            continue
        i = int(_GPU.match(cells[0]).group(1))
        where = f"row GPU{i}"
        if i >= n:
            raise ValueError(f"{where} but the header names only {n} GPUs")
        if i in rows:
            raise ValueError(f"{where} appears twice")
        if len(cells) < n + 1:
            raise ValueError(f"{where} has {len(cells) - 1} cells, fewer than the {n} GPUs")
        rows[i] = [_cell_kind(c, f"{where}, column GPU{j}") for j, c in enumerate(cells[1:n + 1])]
        if rows[i][i] != "self":
            raise ValueError(f"{where}: the diagonal cell is {cells[i + 1]!r}, expected 'X'")
    missing = [f"GPU{i}" for i in range(n) if i not in rows]
    if missing:
        raise ValueError(f"the nvidia-smi topology matrix has no row for {', '.join(missing)}")
    return [rows[i] for i in range(n)]


def _nvml_links(nvml, handles: list) -> list[list[str]]:
    """Link kinds from NVML: NVLink when peer-to-peer over NVLink works (``nvlink:<active links
    to that peer>``, or the device's active links when they end at an NVSwitch), else the PCIe
    level of the pair's closest common ancestor."""
    bus = [nvml.nvmlDeviceGetPciInfo(h).busId for h in handles]
    remote, active = [], []
    for h in handles:
        ends = []
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if nvml.nvmlDeviceGetNvLinkState(h, link) == nvml.NVML_FEATURE_ENABLED:
                    ends.append(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            except nvml.NVMLError:  # no such link on this device
                continue
        remote.append(ends)
        active.append(len(ends))
    n = len(handles)
    matrix = [["self"] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            p2p = nvml.nvmlDeviceGetP2PStatus(handles[i], handles[j],
                                              nvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if p2p == nvml.NVML_P2P_STATUS_OK and active[i]:
                direct = sum(1 for b in remote[i] if b == bus[j])
                matrix[i][j] = f"nvlink:{direct or active[i]}"
            else:
                level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                matrix[i][j] = _NVML_LEVELS.get(int(level), "sys")
    return matrix


def _from_nvml() -> Topology | None:
    try:
        import pynvml as nvml
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
    except Exception:  # no driver, or no GPU
        return None
    try:
        count = nvml.nvmlDeviceGetCount()
        if count < 1:
            return None
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        name = nvml.nvmlDeviceGetName(handles[0])
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handles[0]))
        except nvml.NVMLError:
            gen = None
        return Topology("gpu", count, count, _nvml_links(nvml, handles), "nvml", name, gen)
    except Exception:  # an NVML call this driver does not support: try nvidia-smi
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _run(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_SUBPROCESS_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _from_nvidia_smi() -> Topology | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    text = _run([exe, "topo", "-m"])
    if not text:
        return None
    try:
        matrix = parse_nvidia_smi_topo(text)
    except ValueError:
        return None
    name, gen = "", None
    info = _run([exe, "--query-gpu=name,pcie.link.gen.max", "--format=csv,noheader"])
    if info and info.strip():
        fields = [f.strip() for f in info.splitlines()[0].split(",")]
        name = fields[0]
        gen = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return Topology("gpu", len(matrix), len(matrix), matrix, "nvidia-smi", name, gen)


def cpu_topology() -> Topology:
    """Local processes on the CPU cores of this machine, joined by loopback."""
    n = os.cpu_count() or 1
    matrix = [["self" if i == j else "loopback" for j in range(n)] for i in range(n)]
    return Topology("cpu", n, n, matrix, "cpu")


def detect_topology() -> Topology:
    """This node's topology: NVML, else ``nvidia-smi topo -m``, else the CPU case."""
    return _from_nvml() or _from_nvidia_smi() or cpu_topology()


ISLAND_LINKS = ("nvlink", "pcie-switch")  # links that reach a peer without a host bridge


def pcie_islands(topology: Topology) -> list[list[int]]:
    """This node's devices grouped into PCIe islands: devices that reach each other through NVLink
    or PCIe switches only (``NV#``, ``PIX``, ``PXB``), not through a host bridge or the CPU
    interconnect (``PHB``, ``NODE``, ``SYS``). Islands in order of their first device; a CPU node
    (loopback) is one island."""
    n = len(topology.link_matrix)
    if topology.kind != "gpu":
        return [list(range(n))]
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            if topology.link_matrix[i][j].startswith(ISLAND_LINKS):
                parent[root(j)] = root(i)
    islands: dict[int, list[int]] = {}
    for i in range(n):
        islands.setdefault(root(i), []).append(i)
    return sorted(islands.values())


def ranks_per_island(topology: Topology) -> int | None:
    """``k`` when this node's devices form two or more PCIe islands of ``k ≥ 2`` consecutive
    devices each (local rank ``i`` on device ``i``, as ``torchrun`` places them), else ``None``:
    one island, islands of one device (every pair crosses a host bridge: nothing to stage
    inside), or islands of different sizes or interleaved devices (not modelled)."""
    islands = pcie_islands(topology)
    sizes = {len(island) for island in islands}
    if len(islands) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    k = sizes.pop()
    if any(island != list(range(i * k, (i + 1) * k)) for i, island in enumerate(islands)):
        return None
    return k
