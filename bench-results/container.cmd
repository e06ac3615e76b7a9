script/run-fs-bench.sh --build 
