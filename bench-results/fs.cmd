script/fs-bench.sh --out /work/main/bench-results/fs.tsv keel ext4 tmpfs juicefs 
