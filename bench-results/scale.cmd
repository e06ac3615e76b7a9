script/scale-bench.sh --out /work/wt-25/bench-results/scale.tsv
