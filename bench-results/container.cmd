script/run-fs-bench.sh 
