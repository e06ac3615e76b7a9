env KEEL_ARGS=--io-uring\ off script/fs-bench.sh --out /work/main/bench-results/fs-classic.tsv keel ext4 
