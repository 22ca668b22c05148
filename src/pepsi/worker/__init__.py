"""The worker side: `pepsi worker`, the unified program that runs Python stages."""
