from tests.fakeapi.fixtures import fake_api  # noqa: F401
