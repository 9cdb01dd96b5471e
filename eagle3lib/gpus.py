"""The GPU kinds the plan knows: datasheet figures per kind, each assumed, with its source.

    GPU_KINDS["B300"]            -> (dense bf16 FLOP/s, memory bytes/s, memory GB) per GPU
    INTERCONNECT["RTX-PRO-6000"] -> (bytes/s per direction between two GPUs of the node, what link)
    kind_figures("B300")         -> one line of the kind's figures and their sources (the plan's basis text)

A profile names its kind with train.gpu_kind (params.py validates it against GPU_KINDS); without it
stage_times.gpu_kind guesses the kind from train.gpu_memory_gb. Plain data, so params.py and the
planners read it at once.
"""
from __future__ import annotations

# kind: (dense bf16 FLOP/s, memory bytes/s, memory GB) per GPU. All assumed, from vendor datasheets unless
# stated: H100 / H200 SXM (989 TFLOP/s dense bf16; 3.35 / 4.8 TB/s HBM3 / HBM3e; 80 / 141 GB), B200 / B300
# (2.25 PFLOP/s dense bf16, 8 TB/s HBM3e, 180 / 288 GB). RTX PRO 6000 Blackwell (sm_120, 96 GB GDDR7):
# 1.6 TB/s is the Server edition's datasheet figure (the Workstation edition's is ~1.8 TB/s); ~500 TFLOP/s
# dense bf16 is a third-party figure (NVIDIA's page quotes ~1 PFLOP without saying dense or sparse).
GPU_KINDS = {"H100": (0.989e15, 3.35e12, 80), "H200": (0.989e15, 4.8e12, 141),
             "B200": (2.25e15, 8.0e12, 180), "B300": (2.25e15, 8.0e12, 288),
             "RTX-PRO-6000": (0.5e15, 1.6e12, 96)}

# kind: (bytes/s per direction between two GPUs of an 8-GPU node, the link). All assumed, vendor figures:
# NVLink 4 (H100 / H200 SXM) 900 GB/s per GPU both directions together, NVLink 5 (B200 / B300) 1.8 TB/s;
# the RTX PRO 6000 has no NVLink: PCIe Gen5 x16, ~64 GB/s per direction, and through host memory when
# NCCL_P2P_DISABLE=1 (the P2P workaround on that box) probably less.
INTERCONNECT = {"H100": (450e9, "NVLink 4"), "H200": (450e9, "NVLink 4"),
                "B200": (900e9, "NVLink 5"), "B300": (900e9, "NVLink 5"),
                "RTX-PRO-6000": (64e9, "PCIe Gen5 x16, no NVLink")}

# Where each kind's figures come from (the plan prints it in its bases).
SOURCES = {
    "H100": "vendor datasheet (SXM)",
    "H200": "vendor datasheet (SXM)",
    "B200": "vendor datasheet",
    "B300": "vendor datasheet",
    "RTX-PRO-6000": ("bf16 FLOP/s a third-party figure (NVIDIA quotes ~1 PFLOP, dense or sparse unsaid); "
                     "1.6 TB/s the Server edition's datasheet (Workstation ~1.8 TB/s)"),
}


def pcie_only(kind: str) -> bool:
    """Whether the kind's GPUs talk over PCIe only (no NVLink)."""
    return INTERCONNECT[kind][1].startswith("PCIe")


def kind_figures(kind: str) -> str:
    """One line: the kind's figures, marked assumed, with their source."""
    flops, bandwidth, memory_gb = GPU_KINDS[kind]
    link_bytes, link = INTERCONNECT[kind]
    return (f"assumed {kind}: {flops / 1e15:g} PFLOP/s dense bf16, {bandwidth / 1e12:g} TB/s memory, "
            f"{memory_gb:g} GB, {link} at {link_bytes / 1e9:g} GB/s per direction ({SOURCES[kind]})")
