module github.com/kvhost/kvhost

go 1.26.0

require (
	github.com/BurntSushi/toml v1.6.0
	github.com/lmittmann/tint v1.2.1
	github.com/tetratelabs/wazero v1.12.0
	golang.org/x/sys v0.49.0
)

require github.com/prometheus/client_golang v1.25.0 // indirect
