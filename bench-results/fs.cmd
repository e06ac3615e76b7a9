script/fs-bench.sh --out bench-results/fs.tsv keel ext4 tmpfs juicefs
