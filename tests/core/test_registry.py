"""Model registry: names from the ``autopar.models`` entry points, import paths, errors; and
the library never imports the ``benchmarks`` package (the registry is how it reaches the zoo)."""

import ast
import pathlib
import subprocess
import sys

import jax
import pytest

import autopar
from autopar.errors import InvalidOptionError
from autopar.registry import load_model, model_names, model_step


def test_the_zoo_is_registered_by_name():
    assert {"gpt", "moe", "wide_resnet", "mlp"} <= set(model_names())
    from benchmarks.models import gpt

    assert load_model("gpt") is gpt


def test_model_step_builds_an_abstract_step():
    m = model_step("mlp", "tiny", 4)
    assert m.config.d_in == 16
    assert isinstance(m.args[1]["x"], jax.ShapeDtypeStruct) and m.args[1]["x"].shape == (4, 16)
    assert callable(m.step_fn)


def test_an_import_path_names_an_unregistered_family():
    from benchmarks.models import mlp

    assert load_model("benchmarks.models.mlp") is mlp


@pytest.mark.parametrize(
    "name, message",
    [
        ("bogus", "registered ('autopar.models' entry points): clip, gpt, mlp"),
        ("no_such_pkg.models", "cannot load"),
        ("autopar.errors", "not a model family: it lacks preset, make_train_step"),
    ],
)
def test_unknown_or_unfit_models_are_clear_errors(name, message):
    with pytest.raises(InvalidOptionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(name)


def test_bad_preset_is_an_option_error():
    with pytest.raises(InvalidOptionError, match="unknown GPT preset 'bogus'"):
        model_step("gpt", "bogus", 8)


def test_the_library_imports_no_benchmarks():
    # Statically: no import statement in autopar names the benchmarks package (docstring
    # examples are text, not imports) ...
    root = pathlib.Path(autopar.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] == "benchmarks" for n in names), path
    # ... and at run time, importing the CLI and the demo loads none of it.
    code = (
        "import sys, autopar, autopar.cli, autopar.demo, autopar.registry; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
