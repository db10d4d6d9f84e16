"""Plot a run's reward and key metrics: python scripts/plot_metrics.py RUN_DIR [--out FILE.png]"""

from __future__ import annotations

import argparse

from skyrl.train.utils.plotting import plot_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--out")
    args = parser.parse_args()
    print(plot_metrics(args.run_dir, args.out))


if __name__ == "__main__":
    main()
