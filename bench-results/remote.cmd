script/remote-bench.sh
