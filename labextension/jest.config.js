// The model's unit tests (src/__tests__): plain TypeScript through ts-jest, in node.
module.exports = {
  preset: 'ts-jest',
  testEnvironment: 'node',
  modulePathIgnorePatterns: ['<rootDir>/build/', '<rootDir>/lib/'],
  testRegex: 'src/__tests__/.*\\.spec\\.ts$',
  transform: {
    '^.+\\.ts$': [
      'ts-jest',
      { tsconfig: { types: ['jest'], esModuleInterop: true } }
    ]
  }
};
