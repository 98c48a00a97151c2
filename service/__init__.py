"""kernelmill.service"""
