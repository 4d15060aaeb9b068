"""Package discovery for the folders mapped under ``domainfm``.

pyproject.toml maps each required top-level folder (models/, pretrain/, ...) to a subpackage of
domainfm. setuptools' automatic discovery cannot follow such a mapping, so the packages are
listed here by walking those folders: a new family folder is picked up without editing a list.
"""
from setuptools import find_packages, setup

MAPPED = {
    "domainfm": "src/domainfm",
    "domainfm.models": "models",
    "domainfm.pretrain": "pretrain",
    "domainfm.finetune": "finetune",
    "domainfm.data_loaders": "data_loaders",
    "domainfm.configs": "configs",
}


def _packages():
    packages = []
    for name, folder in MAPPED.items():
        packages.append(name)
        packages.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return packages


setup(packages=_packages(), package_dir=MAPPED)
