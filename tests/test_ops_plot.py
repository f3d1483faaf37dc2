"""The example's --plot: memory over one step without and with STORM, as a PNG."""

from __future__ import annotations

import matplotlib.image

import storm.examples.train_gpt as train_gpt
from storm.report import Timeline

SMALL = ["--steps", "1", "--seq", "32", "--d-model", "32", "--layers", "2", "--heads", "2", "--batch", "4",
         "--min-bytes", "0", "--mode", "embedded", "--no-check"]


def test_plot_writes_a_png_of_the_promised_size_and_offload_lowers_the_peak(tmp_path, capsys, monkeypatch):
    drawn: list[Timeline] = []
    real = train_gpt.plot_memory
    monkeypatch.setattr(train_gpt, "plot_memory", lambda t, *a, **k: (drawn.extend(t), real(t, *a, **k)))
    png = tmp_path / "memory.png"
    # Every save waits for its copy: how far the copy thread gets during this tiny forward
    # would otherwise decide how much is still held at the peak.
    assert train_gpt.main([*SMALL, "--max-held-bytes", "0", "--plot", str(png)]) == 0
    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (600, 1200)  # rows x columns: the default 1200 x 600 pixels
    assert image.std() > 0.05  # not a blank canvas
    without, with_storm = drawn
    assert without.label == "without STORM" and with_storm.label.startswith("with STORM (embedded store")
    assert len(without.ms) > 10 and without.backward_ms is not None and with_storm.backward_ms is not None
    # The saved activations of this model are most of what a step allocates; offloaded, they leave the process.
    assert with_storm.peak_mib < 0.7 * without.peak_mib, (with_storm.peak_mib, without.peak_mib)
    assert f"plot: {png}" in capsys.readouterr().out


def test_quiet_prints_no_step_lines(capsys):
    assert train_gpt.main([*SMALL, "--steps", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "step    0" not in out and out.startswith("done: 2 steps")
