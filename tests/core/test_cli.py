"""CLI: argument parsing, bad input as a clear error (exit 2), show / diff of saved plans."""

from autopar.cli import main, parse_mesh
from tests.core.test_plan import _plan


def test_parse_mesh():
    assert parse_mesh("data=2,tensor=4") == {"data": 2, "tensor": 4}
    assert parse_mesh(None) is None


def test_bad_input_exits_2_with_a_message(capsys):
    assert main(["trace", "gpt", "--preset", "bogus"]) == 2
    assert "unknown GPT preset 'bogus'" in capsys.readouterr().err
    assert main(["plan", "gpt", "--mesh", "data=x"]) == 2
    assert "axis=size" in capsys.readouterr().err
    assert main(["show", "/nonexistent/plan.json"]) == 2
    assert "no plan file" in capsys.readouterr().err


def test_show_and_diff_saved_plans(tmp_path, capsys):
    a = tmp_path / "a.json"
    _plan().save(a)
    assert main(["show", str(a)]) == 0
    assert "data=2 x tensor=4" in capsys.readouterr().out
    assert main(["diff", str(a), str(a)]) == 0
    assert "plans are identical" in capsys.readouterr().out
