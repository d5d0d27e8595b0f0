"""torchrec_swp: TorchRec's training pipelines as declarative plans on one shared engine.

A guest in the user's environment: it declares what it needs at the loosest versions it works
with and never names a torch build or an fbgemm package. The exact pins of this repository's own
environments are in ``requirements/`` (see docs/install.md).

TorchRec is checked when the pipelines are imported, not declared here: PyPI's torchrec wheels
require ``fbgemm-gpu`` (the CUDA build) by name, so a requirement on torchrec makes pip add the
CUDA fbgemm-gpu to every environment whose fbgemm is PyPI's CPU build ``fbgemm-gpu-cpu`` (both
ship the ``fbgemm_gpu`` package; the CUDA one does not load without a GPU driver). Where pip
should bring TorchRec too, ask for the extra: ``pip install torchrec_swp[torchrec]``.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = re.search(r'^__version__ = "([^"]+)"', (here / "torchrec_swp" / "__init__.py").read_text(), re.M)

# The supported TorchRec series (torchrec_swp/integrations/torchrec/compat.py checks them on import).
TORCHREC = "torchrec>=1.8,<1.10"
EXAMPLES = ["torchdata>=0.11", "torchx>=0.7", "matplotlib>=3.7"]
AUTOSCHED = ["ortools>=9.12", "tqdm>=4.64"]

setup(
    name="torchrec_swp",
    version=version.group(1),
    description="Declarative, multi-thread, multi-stream training pipelines for TorchRec",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    packages=find_packages(include=["torchrec_swp", "torchrec_swp.*"]),
    python_requires=">=3.11",
    install_requires=["torch>=2.13", "typing_extensions>=4.5"],
    extras_require={
        "torchrec": [TORCHREC],
        "examples": EXAMPLES,
        "autosched": AUTOSCHED,
        "dev": [
            *EXAMPLES, *AUTOSCHED, "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "ruff>=0.15", "mypy>=2"
        ],
    },
    classifiers=[
        "License :: OSI Approved :: BSD License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
