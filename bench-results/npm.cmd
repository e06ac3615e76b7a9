script/npm-bench.sh --out /work/main/bench-results/npm.tsv keel keel-wb ext4 tmpfs juicefs 
