"""examples/policy_tuning.ipynb runs top to bottom (small size) in a fresh kernel, writes its
plots and shows no error."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "policy_tuning.ipynb"
PLOTS = ("nvme_bench", "step_time", "peak_memory", "predicted_vs_measured", "knobs")


def test_policy_tuning_notebook_runs(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    tags = [c.metadata.get("tags", []) for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in tags[0]
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "the committed notebook keeps no outputs"

    out = tmp_path / "out"
    # The kernel is a child process: it inherits these.
    monkeypatch.setenv("TIEROFFLOAD_NB_DIR", str(tmp_path / "nvme"))
    monkeypatch.setenv("TIEROFFLOAD_NB_SIZE", "small")
    monkeypatch.setenv("TIEROFFLOAD_NB_OUT", str(out))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first cell that fails

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, [f"{e.ename}: {e.evalue}" for e in errors]
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.outputs if o.output_type == "stream")
    assert "Traceback" not in text
    assert "auto / best measured" in text or "Policy.auto:" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) >= len(PLOTS), "the figures are shown inline, not only saved"
    for name in PLOTS:
        png = out / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 0, png
