script/npm-bench.sh --out /work/wt-bench/bench-results/npm.tsv keel keel-wb ext4 tmpfs juicefs 
