"""Packaging of dist_checkpointing. Tool configuration (ruff, mypy, pytest) is in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent

DEV_REQUIRES = [
    "pytest>=8",
    "pytest-timeout>=2.2",
    "hypothesis>=6",
    "ruff>=0.6",
    "mypy>=1.10",
    # The msc:// tests start moto's S3 server on 127.0.0.1 (tests/support/msc_server.py).
    "moto[server]>=5",
    "boto3",
]
DOCS_REQUIRES = ["sphinx>=7"]
CLI_REQUIRES = ["tqdm>=4.60", "safetensors>=0.4"]
MSC_REQUIRES = ["multi-storage-client>=1.0"]
# Local checkpoints (tensor_aware_state_dict) with nvidia-resiliency-ext's checkpoint managers.
# pynvml 13 (a dependency of it) warns on every `import torch`; 12 is the same API, silent.
NVRX_REQUIRES = ["nvidia-resiliency-ext>=0.4", "pynvml<13"]
# ISA-L's CRC-32 for the zip records of torch_dist items: zlib's values, about 10x faster.
ISAL_REQUIRES = ["isal>=1.0"]

setup(
    name="dist_checkpointing",
    version="0.1.0",
    description=(
        "Save and load sharded model state across torch.distributed ranks, compatible with "
        "Megatron-Core dist_checkpointing and the PyTorch DCP on-disk format."
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(exclude=["tests", "tests.*", "bench", "bench.*", "examples", "docs"]),
    package_data={"dist_checkpointing": ["py.typed"]},
    include_package_data=False,
    zip_safe=False,
    python_requires=">=3.10",
    # crc32c: the checksums of every item (hardware CRC32C, ~15 GB/s per core).
    install_requires=["torch>=2.4", "numpy", "psutil", "crc32c>=2.4"],
    extras_require={
        "dev": DEV_REQUIRES + DOCS_REQUIRES,
        "docs": DOCS_REQUIRES,
        # The CLI (python -m dist_checkpointing): progress bars, safetensors conversion.
        "cli": CLI_REQUIRES,
        # msc:// checkpoint URLs (object storage through multi-storage-client profiles).
        "msc": MSC_REQUIRES,
        "nvrx": NVRX_REQUIRES,
        # Faster torch_dist saves: the CRC-32 torch.save puts in each item, from ISA-L.
        "isal": ISAL_REQUIRES,
    },
    entry_points={"console_scripts": ["dist-checkpointing = dist_checkpointing.cli:main_exit"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
)
