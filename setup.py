"""torchrec_swp: TorchRec's training pipelines as declarative plans on one shared engine."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent


def requirements(name: str) -> list[str]:
    lines = (here / "requirements" / name).read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


setup(
    name="torchrec_swp",
    version="0.1.0",
    description="Declarative, multi-thread, multi-stream training pipelines for TorchRec",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchrec_swp", "torchrec_swp.*"]),
    python_requires=">=3.10",
    # torchrec==1.8.0 is required too, but must be installed with --no-deps (see the Makefile):
    # its metadata pulls the CUDA fbgemm-gpu. torchrec_swp checks its version on import.
    install_requires=requirements("runtime.txt"),
    extras_require={"dev": requirements("dev.txt")},
)
