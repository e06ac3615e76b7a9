script/run-fs-bench.sh -- --reps 2 
