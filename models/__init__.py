"""domainfm.models — installed as a subpackage of domainfm, never as a top-level package."""
if not __name__.startswith("domainfm."):
    raise ImportError(
        f"'{__name__}' is the repository folder of domainfm.models and is not a top-level package: "
        "install the project (pip install -e '.[test]') and import 'domainfm.models' instead."
    )

import importlib
import pkgutil

__all__ = ["import_families"]

_IMPORTED = False


def import_families() -> None:
    """Import every family subpackage so that its ``@register_model`` builders run.

    Families are discovered from the folders under ``models/``: adding a family is adding a
    folder, never editing a list.
    """
    global _IMPORTED
    if _IMPORTED:
        return
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.ispkg and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    _IMPORTED = True
