env KEEL_ARGS=--passthrough\ off script/fs-bench.sh --out /work/main/bench-results/fs-wb.tsv keel ext4 
