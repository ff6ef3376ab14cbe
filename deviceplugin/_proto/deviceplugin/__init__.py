"""Generated from protos/deviceplugin; do not edit."""
