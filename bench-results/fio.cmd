script/fio-bench.sh --out /work/main/bench-results/fio.tsv keel keel-wb ext4 tmpfs juicefs 
