"""quantkit's GPU kernels, imported as ``quantkit.kernels`` (pyproject maps this folder there).

The folder sits at the top of the repository, and Hugging Face's ``kernels`` package (a dependency
of transformers) has the same name. Whenever the repository root is on ``sys.path`` (``python -m
pytest`` or ``python -c`` run from the checkout, torchrun ranks started with ``python -m``), a plain
``import kernels`` reaches this file before site-packages, and transformers would get our folder
instead of its dependency. Imported under that bare name, this module therefore steps aside: it
loads the ``kernels`` that the rest of ``sys.path`` holds and leaves that in ``sys.modules``; where
there is none, it leaves an empty namespace module (no ``__file__``), which is what Python gives
for a folder without ``__init__.py`` and what transformers' availability checks read as absent.
Under its real name, ``quantkit.kernels``, nothing here runs.
"""

if __name__ == "kernels":

    def _step_aside() -> None:
        import importlib.machinery
        import importlib.util
        import os
        import sys

        root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        elsewhere = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
        if spec is None:
            spec = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        module = importlib.util.module_from_spec(spec)
        # The import system returns whatever sys.modules holds under the name once this file has run.
        sys.modules["kernels"] = module
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader.exec_module(module)

    _step_aside()
    del _step_aside
