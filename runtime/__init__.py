"""kernelmill.runtime"""
