script/rss-bench.sh
