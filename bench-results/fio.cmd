script/fio-bench.sh --out bench-results/fio.tsv keel keel-wb ext4 tmpfs juicefs
