script/fio-bench.sh --out /work/main/bench-results/fio-wb.tsv keel keel-wb ext4 
