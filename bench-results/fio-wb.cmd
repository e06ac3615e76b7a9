script/fio-bench.sh --out /work/wt-bench/bench-results/fio-wb.tsv keel keel-wb ext4 
