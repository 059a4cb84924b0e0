"""bench.first_hour as CI can afford it: the tiny model's save_pretrained copy, a small quick run and its check,
through the benchmark's own command line; the figures it prints are the commands' wall times (the targets are the
benchmark's on SmolLM2, not asserted here: no timed tests)."""
import json

from bench import first_hour

SMALL = ["data.n_samples=2", "data.seq_len=128", "data.eval_n_samples=2", "data.eval_seq_len=128",
         "traces.reservoir_size=64", "probes.lengths=[256]", "check.contexts=[32]"]


def test_first_hour_times_run_and_check_and_prints_the_stage_table(tmp_path, capsys):
    out = tmp_path / "first_hour.json"
    assert first_hour.main(["--model", "tiny", "--extra", *SMALL, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())["figures"]
    assert set(figures) == {"run", "check"}
    for name, fig in figures.items():
        assert fig["wall_s"] > 0 and 0 <= fig["others_cpu"] <= 1
        row = next(line.split() for line in printed.splitlines() if line.split()[:1] == [name])
        assert abs(float(row[1]) - fig["wall_s"]) <= 0.051  # printed to 0.1 s, recorded to 0.01 s
    table = json.loads(out.read_text())["stage_table"]
    names = " ".join(row.split()[0] for row in table[2:])
    assert "traces" in names and "runtime" in names and "quality" in names and "load" in names
    assert "check's own line: load model" in printed
