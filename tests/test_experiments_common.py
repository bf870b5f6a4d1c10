"""The helpers every study shares (experiments/common.py)."""

from experiments.common import print_headline


def test_print_headline_keeps_small_figures_visible(capsys):
    print_headline({"error": 4.39e-05, "tok_s": 118.634, "ratio": 0.6412, "n": 3, "zero": 0.0, "neg": -2e-06})
    line = capsys.readouterr().out.strip()
    assert line == ("headline: {'error': 4.39e-05, 'tok_s': 118.634, 'ratio': 0.641, 'n': 3, "
                    "'zero': 0.0, 'neg': -2e-06}")
