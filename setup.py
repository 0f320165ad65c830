# Everything is in pyproject.toml except one thing it cannot say: the top-level kernels/ folder is
# installed as the package megalite._kernels, so wheels carry the CUDA sources megalite.ops builds.
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["megalite*"]) + ["megalite._kernels"],
    package_dir={"megalite._kernels": "kernels"},
)
