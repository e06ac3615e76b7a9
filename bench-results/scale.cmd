script/scale-bench.sh --out /work/main/bench-results/scale.tsv 
