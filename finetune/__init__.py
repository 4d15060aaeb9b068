"""domainfm.finetune — installed as a subpackage of domainfm, never as a top-level package."""
if not __name__.startswith("domainfm."):
    raise ImportError(
        f"'{__name__}' is the repository folder of domainfm.finetune and is not a top-level package: "
        "install the project (pip install -e '.[test]') and import 'domainfm.finetune' instead."
    )
