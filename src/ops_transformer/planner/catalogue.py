"""The hardware catalogue: accelerators and the links between them, from vendors' datasheets.

Every number carries its source. FLOP/s are dense peaks (no 2:4 structured sparsity: datasheets
that print sparse figures are halved here). Link bandwidths are *effective*: bytes per second one
GPU sends in one direction inside a collective, i.e. the nominal per-direction figure times an
assumed efficiency, stated next to each link. A link's ``latency_s`` is the cost of one step of a
collective (one hop of a ring); a ring all-reduce over ``p`` ranks pays ``2(p−1)`` of them. The
step latencies follow NCCL's own tuning model (``hwLat`` for the ring algorithm, LL128 protocol, in
``src/graph/tuning.cc``, NCCL 2.x, NVIDIA 2019–2024), which also adds a fixed base latency of a few
µs per call that the cost model may charge separately.

Memory capacities are the vendors' "GB" read as GiB where the HBM stacks are binary (an A100 40GB
reports 40960 MiB in ``nvidia-smi``); the usable amount is slightly lower.

These are starting points for the planner; ``ops-transformer calibrate`` replaces them with a
profile measured on the machine at hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

_GiB = 1 << 30
_GB = 1e9
_T = 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    fp16_flops: float  # dense peak, FLOP/s
    fp32_flops: float  # dense peak without TF32, FLOP/s (what torch runs by default)
    memory_bytes: int
    memory_bandwidth: float  # HBM bytes/s
    intra_link: str  # default link between GPUs of one node, a key of LINKS
    gpus_per_node: int  # typical node (baseboard) size
    vendor: str
    fp8_flops: float = 0.0  # dense FP8 tensor-core peak, FLOP/s (0: no FP8 units)
    sms: int = 0  # streaming multiprocessors (CUs): the wave size of a GEMM (0: not modelled)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # effective bytes/s per GPU per direction in a collective
    latency_s: float  # one step of a collective (one ring hop), seconds

    def to_dict(self) -> dict:
        return asdict(self)


# FP8 dense peaks: H100 SXM / H200 datasheets 3,958 TFLOP/s with sparsity (1,979 dense), H100
# PCIe 3,026 (1,513), B200 9 PFLOP/s (4.5 dense), MI300X data sheet 2,614.9 dense; V100 and A100
# have no FP8 units.
# SMs (the wave size of a GEMM): Tesla V100 datasheet 80; NVIDIA A100 architecture whitepaper
# (2020) 108; NVIDIA H100 architecture whitepaper (2022) SXM5 132 (so H200 and the 96 GB SXM),
# PCIe 114; NVIDIA Blackwell architecture technical brief (2024) 148 per B200; AMD MI300X data
# sheet (2023) 304 compute units.
GPUS: dict[str, GPU] = {
    # NVIDIA Tesla V100 GPU datasheet (2020), SXM2 32 GB: 125 TFLOP/s fp16 tensor, 15.7 TFLOP/s
    # fp32, 900 GB/s HBM2, NVLink 300 GB/s. Volta has no bf16 units: bf16 runs at best at the fp32
    # rate, so that is the figure here. Node: DGX-1 with 8 V100 (NVIDIA DGX-1 datasheet, 2018).
    "v100": GPU("v100", bf16_flops=15.7 * _T, fp16_flops=125 * _T, fp32_flops=15.7 * _T,
                memory_bytes=32 * _GiB, memory_bandwidth=900 * _GB, intra_link="nvlink2",
                gpus_per_node=8, vendor="nvidia", sms=80),
    # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM: bf16/fp16 312 TFLOP/s dense (624 sparse),
    # fp32 19.5 TFLOP/s (TF32 156), 40 GB HBM2 at 1,555 GB/s, NVLink 600 GB/s. Node: DGX A100,
    # 8 GPUs (NVIDIA DGX A100 datasheet, 2020).
    "a100-40gb": GPU("a100-40gb", bf16_flops=312 * _T, fp16_flops=312 * _T, fp32_flops=19.5 * _T,
                     memory_bytes=40 * _GiB, memory_bandwidth=1555 * _GB, intra_link="nvlink3",
                     gpus_per_node=8, vendor="nvidia", sms=108),
    # Same datasheet (2021), A100 80GB SXM: same compute, 80 GB HBM2e at 2,039 GB/s.
    "a100-80gb": GPU("a100-80gb", bf16_flops=312 * _T, fp16_flops=312 * _T, fp32_flops=19.5 * _T,
                     memory_bytes=80 * _GiB, memory_bandwidth=2039 * _GB, intra_link="nvlink3",
                     gpus_per_node=8, vendor="nvidia", sms=108),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: bf16/fp16 1,979 TFLOP/s with sparsity
    # (989.5 dense), fp32 67 TFLOP/s, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s. Node: DGX/HGX H100,
    # 8 GPUs (NVIDIA DGX H100 datasheet, 2023).
    "h100-sxm": GPU("h100-sxm", bf16_flops=989.5 * _T, fp16_flops=989.5 * _T, fp32_flops=67 * _T,
                    memory_bytes=80 * _GiB, memory_bandwidth=3350 * _GB, intra_link="nvlink4",
                    gpus_per_node=8, vendor="nvidia", fp8_flops=1979 * _T, sms=132),
    # Same datasheet (2023), H100 PCIe: bf16/fp16 1,513 TFLOP/s with sparsity (756.5 dense), fp32
    # 51 TFLOP/s, 80 GB HBM2e at 2 TB/s, PCIe Gen5 128 GB/s. NVLink bridges join pairs only, so the
    # node default is PCIe 5; 8 cards per server is an assumption (common, not a standard).
    "h100-pcie": GPU("h100-pcie", bf16_flops=756.5 * _T, fp16_flops=756.5 * _T, fp32_flops=51 * _T,
                     memory_bytes=80 * _GiB, memory_bandwidth=2000 * _GB, intra_link="pcie5",
                     gpus_per_node=8, vendor="nvidia", fp8_flops=1513 * _T, sms=114),
    # H100 SXM with 96 GB of HBM2e at 2.4 TB/s and a 500 W power limit (the variant Meta's Grand
    # Teton hosts carry): torchtitan's H100 benchmarks (benchmarks/llama3_h100_202412_torchtitan.md,
    # pytorch/torchtitan, 2024) give 96 GB HBM2e, 2.4 TB/s, 500 W, 8 GPUs per host over NVLink,
    # 400 Gb/s RDMA per GPU, and 95 GiB usable per GPU. Its peak is "between SXM and NVL" at that
    # power (same source): the SXM figure is kept here, as torchtitan computes MFU, and the lower
    # sustained clock shows up in the efficiency fitted for this card (.efficiency).
    "h100-sxm-96gb": GPU("h100-sxm-96gb", bf16_flops=989.5 * _T, fp16_flops=989.5 * _T,
                         fp32_flops=67 * _T, memory_bytes=95 * _GiB,
                         memory_bandwidth=2400 * _GB, intra_link="nvlink4", gpus_per_node=8,
                         vendor="nvidia", fp8_flops=1979 * _T, sms=132),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM: compute as H100 SXM (bf16 1,979
    # sparse → 989.5 dense, fp32 67), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; HGX H200, 8 GPUs.
    # 141 GB is not a binary size: nvidia-smi reports 143771 MiB, about 140.4 GiB.
    "h200": GPU("h200", bf16_flops=989.5 * _T, fp16_flops=989.5 * _T, fp32_flops=67 * _T,
                memory_bytes=143771 * (1 << 20), memory_bandwidth=4800 * _GB,
                intra_link="nvlink4", gpus_per_node=8, vendor="nvidia",
                fp8_flops=1979 * _T, sms=132),
    # NVIDIA HGX B200 specifications / Blackwell datasheet (2024), B200 at 1,000 W: bf16/fp16 4.5
    # PFLOP/s with sparsity (2.25 dense), fp32 80 TFLOP/s, 8 TB/s HBM3e, NVLink 5 1.8 TB/s per GPU.
    # Memory: 192 GB physical, 180 GB usable per GPU (NVIDIA DGX B200 datasheet, 2024: 1,440 GB
    # for 8 GPUs).
    "b200": GPU("b200", bf16_flops=2250 * _T, fp16_flops=2250 * _T, fp32_flops=80 * _T,
                memory_bytes=180 * _GiB, memory_bandwidth=8000 * _GB, intra_link="nvlink5",
                gpus_per_node=8, vendor="nvidia", fp8_flops=4500 * _T, sms=148),
    # AMD Instinct MI300X accelerator data sheet (2023): bf16/fp16 1,307.4 TFLOP/s dense (2,614.9
    # with sparsity), fp32 163.4 TFLOP/s, 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links; AMD
    # Instinct MI300X platform (2023): 8 GPUs, fully connected.
    "mi300x": GPU("mi300x", bf16_flops=1307.4 * _T, fp16_flops=1307.4 * _T, fp32_flops=163.4 * _T,
                  memory_bytes=192 * _GiB, memory_bandwidth=5300 * _GB,
                  intra_link="infinity-fabric", gpus_per_node=8, vendor="amd",
                  fp8_flops=2614.9 * _T, sms=304),
}


# Assumed efficiencies of collectives against the nominal per-direction bandwidth. NVLink/NVSwitch:
# nccl-tests all-reduce bus bandwidth on full DGX nodes lands near 80% of the per-direction link
# rate. PCIe: transfers cross the root complex or a switch and share lanes, 70% assumed. InfiniBand:
# one NIC per GPU (the DGX A100/H100 layout), large messages reach about 90% of line rate.
_NVLINK_EFF, _PCIE_EFF, _IB_EFF = 0.8, 0.7, 0.9
# NCCL tuning.cc, ring LL128 per-step hwLat: NVLink 1.9 µs, PCI 2.5 µs, network 4.0 µs.
_NVLINK_LAT, _PCIE_LAT, _NET_LAT = 1.9e-6, 2.5e-6, 4.0e-6

LINKS: dict[str, Link] = {
    # NVLink 2 on V100 SXM2: 300 GB/s total, 150 GB/s per direction (Tesla V100 datasheet, 2020).
    "nvlink2": Link("nvlink2", bandwidth=_NVLINK_EFF * 150 * _GB, latency_s=_NVLINK_LAT),
    # NVLink 3 on A100 SXM: 600 GB/s total, 300 per direction (A100 datasheet, 2021).
    "nvlink3": Link("nvlink3", bandwidth=_NVLINK_EFF * 300 * _GB, latency_s=_NVLINK_LAT),
    # NVLink 4 on H100/H200 SXM: 900 GB/s total, 450 per direction (H100 datasheet, 2023).
    "nvlink4": Link("nvlink4", bandwidth=_NVLINK_EFF * 450 * _GB, latency_s=_NVLINK_LAT),
    # NVLink 5 on B200: 1.8 TB/s total, 900 per direction (HGX B200 specifications, 2024).
    "nvlink5": Link("nvlink5", bandwidth=_NVLINK_EFF * 900 * _GB, latency_s=_NVLINK_LAT),
    # PCIe 4.0 x16: 16 GT/s × 16 lanes, 128b/130b coding ≈ 31.5 GB/s per direction (PCI Express
    # Base Specification 4.0, PCI-SIG 2017).
    "pcie4": Link("pcie4", bandwidth=_PCIE_EFF * 31.5 * _GB, latency_s=_PCIE_LAT),
    # PCIe 5.0 x16: 32 GT/s × 16 lanes ≈ 63 GB/s per direction (PCIe Base Specification 5.0,
    # PCI-SIG 2019).
    "pcie5": Link("pcie5", bandwidth=_PCIE_EFF * 63 * _GB, latency_s=_PCIE_LAT),
    # MI300X Infinity Fabric: 7 links × 128 GB/s bidirectional = 896 GB/s peak aggregate, so
    # 448 GB/s per direction when a collective spreads over all 7 peers (MI300X data sheet, 2023).
    # Assumed: 70% of it (RCCL runs several rings over the full mesh) and NVLink's step latency.
    "infinity-fabric": Link("infinity-fabric", bandwidth=0.7 * 448 * _GB, latency_s=_NVLINK_LAT),
    # InfiniBand HDR: 200 Gb/s = 25 GB/s per direction per port (NVIDIA ConnectX-6 datasheet, 2020),
    # one port per GPU as in DGX A100.
    "ib-hdr": Link("ib-hdr", bandwidth=_IB_EFF * 25 * _GB, latency_s=_NET_LAT),
    # InfiniBand NDR: 400 Gb/s = 50 GB/s per direction per port (NVIDIA ConnectX-7 datasheet, 2022),
    # one port per GPU as in DGX H100.
    "ib-ndr": Link("ib-ndr", bandwidth=_IB_EFF * 50 * _GB, latency_s=_NET_LAT),
    # Local processes over gloo/loopback, rough: hardware.CPU_GLOO measured ~0.94 GB/s bus bandwidth
    # and α ≈ 2.2e-4 s for a 2-rank all-reduce (2 ring steps) on the shared 2-core dev VM.
    "loopback": Link("loopback", bandwidth=0.94 * _GB, latency_s=1.1e-4),
}


# Other spellings of catalogue names (the key is normalised: lower case, "-" for "_").
ALIASES = {"h100": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm-80gb": "h100-sxm",
           "h100-96gb": "h100-sxm-96gb", "h100-96gb-500w": "h100-sxm-96gb",
           "h100-sxm-96gb-500w": "h100-sxm-96gb", "a100-sxm-80gb": "a100-80gb",
           "a100-sxm-40gb": "a100-40gb", "h200-sxm": "h200", "v100-32gb": "v100",
           "ndr": "ib-ndr", "hdr": "ib-hdr"}


def _lookup(table: dict, kind: str, name: str):
    key = str(name).strip().lower().replace("_", "-")
    key = key if key in table else ALIASES.get(key, key)
    if key not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}")
    return table[key]


def gpu(name: str) -> GPU:
    """The catalogue entry for ``name``, case-insensitive, ``_`` or ``-``: ``gpu("A100_80GB")``."""
    return _lookup(GPUS, "GPU", name)


def link(name: str) -> Link:
    """The catalogue entry for ``name``, case-insensitive, ``_`` or ``-``: ``link("IB_NDR")``."""
    return _lookup(LINKS, "link", name)


def gpu_for_device(device_name: str, memory_bytes: int) -> str | None:
    """The catalogue card a CUDA/ROCm device is (``torch.cuda.get_device_name`` and its total
    memory), or ``None`` when the catalogue has no such card. The memory tells apart the cards
    that share a name: A100 40/80 GB, H100 80/96 GB."""
    name = device_name.upper()
    gib = memory_bytes / _GiB
    if "MI300X" in name:
        return "mi300x"
    if "B200" in name:
        return "b200"
    if "H200" in name:
        return "h200"
    if "H100" in name:
        if "PCIE" in name:
            return "h100-pcie"
        return "h100-sxm-96gb" if gib > 88 else "h100-sxm"
    if "A100" in name:
        return "a100-80gb" if gib > 60 else "a100-40gb"
    if "V100" in name:
        return "v100"
    return None
